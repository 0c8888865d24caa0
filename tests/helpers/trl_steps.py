"""TRL's GRPOTrainer for one step on an agentenv ``environment_factory`` (local or served),
with a tiny model that learned one solution by heart (``memorized``), so TRL's own loop makes
real tool calls into the env and the env scores a real answer."""

from memorized import memorize

from agentenv.integrations.trl import reward_func


def memorized_policy(tokenizer, factory, row, turns):
    """A tiny model that answers ``row`` with ``turns`` (tool calls, then an answer)."""
    env = factory()
    env.reset(**row)
    # in TRL's order: inspect.getmembers lists the methods by name
    tools = [getattr(env, name) for name in sorted(t.name for t in env._inner.tools)]
    conversation = list(row["prompt"])
    for name, arguments in turns[:-1]:
        call = {"type": "function", "function": {"name": name, "arguments": arguments}}
        result = getattr(env, name)(**arguments)
        conversation += [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": name, "content": result},
        ]
    conversation.append({"role": "assistant", "content": turns[-1]})
    text = tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False)
    prompt = tokenizer.apply_chat_template(
        row["prompt"], tools=tools, tokenize=False, add_generation_prompt=True
    )
    return memorize(tokenizer, text, prompt)


def train_one_step(model, tokenizer, factory, rows, tmp_path, batch=2):
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=batch,
        num_generations=2,
        max_completion_length=256,
        max_tool_calling_iterations=2,
        generation_kwargs={"max_new_tokens": 96},
        temperature=0.1,  # the memorised text, near-greedily: a long call survives sampling
        use_cpu=True,
        bf16=False,  # TRL's default is bf16 mixed precision, even where the CPU lacks bf16
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=reward_func,
        train_dataset=rows,
        environment_factory=factory,
        args=args,
    )
    trainer.train()
    return trainer
