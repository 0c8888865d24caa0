"""The LLM judge: parsing, batching, caching, failures; one run with a real small model."""

import time

import pytest
from memorized import memorize

from agentenv.errors import InvalidOptionError
from agentenv.run.judge import LLMJudge, OpenAIJudge, TransformersJudge, parse_verdict


class Scripted:
    """A backend whose reply to a chat is ``reply(chat)``; it records every call."""

    def __init__(self, reply):
        self.reply = reply
        self.calls = []

    def complete(self, chats):
        self.calls.append(len(chats))
        return [self.reply(chat) for chat in chats]


def grade_by_answer(chat):
    answer = chat[1]["content"].rsplit("Candidate answer:\n", 1)[1]
    return {"Paris": "<score>10</score>", "Lyon": "<score> 3 </score>"}.get(answer, "dunno")


def test_grades_are_parsed_batched_and_cached():
    backend = Scripted(grade_by_answer)
    judge = LLMJudge(backend, fallback=-1.0)
    items = [("Capital of France?", a, "Paris") for a in ("Paris", "Lyon", "Paris", "Nice")]
    verdicts = judge.score_batch(items)
    assert [v.reward for v in verdicts] == [1.0, 0.3, 1.0, -1.0]
    assert verdicts[3].error == "no <score>N</score> in the reply"
    assert backend.calls == [3]  # one call, the repeated triple once
    assert judge.score("Capital of France?", "Paris", "Paris") == 1.0
    assert backend.calls == [3]  # cached
    assert judge.score("Capital of France?", "Nice", "Paris") == -1.0
    assert backend.calls == [3, 1]  # a failed grade is tried again
    assert judge.stats == {"calls": 2, "graded": 2, "cached": 2, "failures": 2}
    chat = judge.chat("Q?", "A", None)
    assert "Reference" not in chat[1]["content"] and "<score>N</score>" in chat[0]["content"]


def test_a_backend_error_or_timeout_gives_the_fallback():
    def boom(chat):
        raise ConnectionError("refused")

    judge = LLMJudge(Scripted(boom), fallback=0.25)
    (verdict,) = judge.score_batch([("q", "a", None)])
    assert verdict.reward == 0.25 and verdict.error == "ConnectionError: refused"

    def slow(chat):
        time.sleep(2)
        return "<score>9</score>"

    judge = LLMJudge(Scripted(slow), timeout_s=0.2)
    start = time.perf_counter()
    (verdict,) = judge.score_batch([("q", "a", None)])
    assert time.perf_counter() - start < 1.5
    assert verdict.reward == 0.0 and "no reply within 0.2 s" in verdict.error


def test_parse_and_bad_settings():
    assert parse_verdict("ok <score>7</score>", 0.0).reward == 0.7
    assert parse_verdict("<score>11</score>", 0.0).error == "grade 11 is outside 0..10"
    with pytest.raises(InvalidOptionError, match="timeout_s"):
        LLMJudge(Scripted(grade_by_answer), timeout_s=0)
    with pytest.raises(InvalidOptionError, match="http"):
        OpenAIJudge("localhost:8000", "m")


def test_a_small_local_model_judges_through_the_generation_path(tokenizer):
    judge_chat = LLMJudge(Scripted(grade_by_answer)).chat("Capital of France?", "Paris", "Paris")
    from agentenv.rollout.episode import ChatFormat

    fmt = ChatFormat(tokenizer)
    prompt = fmt.render(judge_chat, add_generation_prompt=True)
    model = memorize(tokenizer, prompt + "<score>8</score><|im_end|>\n", prompt)
    # A generous limit: this test is about the path, not the timeout (under 14 test workers
    # on a 16-core GPU machine it failed once and passed alone; the 60 s default is the
    # likeliest cause). A failure prints the verdict, its error included.
    judge = LLMJudge(TransformersJudge(model, tokenizer), timeout_s=600)
    (verdict,) = judge.score_batch([("Capital of France?", "Paris", "Paris")])
    assert verdict.reply == "<score>8</score>" and verdict.reward == 0.8, verdict


@pytest.mark.slow
def test_the_default_local_judge_runs_offline(smollm2):
    """The bundled SmolLM2 as a judge, through TransformersJudge: a grade or a fallback
    that says why (it is a weak judge; this checks the path, not its judgement)."""
    model, tokenizer = smollm2
    judge = LLMJudge(TransformersJudge(model, tokenizer), fallback=-1.0)
    (verdict,) = judge.score_batch([("What is 2 + 2?", "4", "4")])
    assert verdict.reply  # the model said something
    assert (verdict.error is None and 0 <= verdict.reward <= 1) or (
        verdict.reward == -1.0 and verdict.error
    )
    assert judge.stats["calls"] == 1
