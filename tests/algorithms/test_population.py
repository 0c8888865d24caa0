"""A population of adapters on one base: switching, copying, saving (tiny model)."""

from __future__ import annotations

import pytest
import torch
from toy_episodes import SAMPLING, make_groups

from agentenv.errors import InvalidOptionError
from agentenv.lm.models import tiny_model as build
from algorithms.config import GRPOConfig
from algorithms.grpo import GRPO
from algorithms.population import Population, best_member, set_peak_lr

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

GROUPS = make_groups([[0, 1, 1, 0], [1, 0, 0, 0]])


def hp(lr: float, **kw: float) -> dict[str, float]:
    return {"learning_rate": lr, "beta": 0.0, "entropy_coef": 0.0, "temperature": 1.0, **kw}


def make_population(tokenizer, lrs=(1e-3, 2e-3, 4e-3), **grpo) -> Population:
    torch.manual_seed(0)
    cfg = GRPOConfig(learning_rate=1e-3, lora_r=4, lora_alpha=8, **grpo)
    algo = GRPO(build(tokenizer), tokenizer, cfg, sampling=SAMPLING)
    return Population(algo, [hp(lr) for lr in lrs], SAMPLING)


def live(pop: Population) -> list[torch.Tensor]:
    return [p.detach().clone() for p in pop.trainer._params]


def adam_state(optimizer) -> list[torch.Tensor]:
    return [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]


def test_switching_members_never_leaks_one_adapter_into_another(tokenizer):
    pop = make_population(tokenizer)
    start = live(pop)
    pop.activate(1)
    pop.trainer.learn(GROUPS)
    trained = live(pop)
    assert any(
        not torch.equal(a, b) for a, b in zip(start, trained, strict=True)
    )  # member 1 learned
    pop.activate(2)  # member 2 never trained: the start, not member 1's weights
    assert all(torch.equal(a, b) for a, b in zip(live(pop), start, strict=True))
    pop.activate(0)
    assert all(torch.equal(a, b) for a, b in zip(live(pop), start, strict=True))
    pop.activate(1)  # member 1 gets back exactly what it learned
    assert all(torch.equal(a, b) for a, b in zip(live(pop), trained, strict=True))


def test_each_member_trains_with_its_own_optimizer_lr_and_settings(tokenizer):
    pop = make_population(tokenizer)
    optimizers = [m.own["optimizer"] for m in pop.members]
    assert len({id(o) for o in optimizers}) == 3
    for index, lr in enumerate((1e-3, 2e-3, 4e-3)):
        pop.activate(index)
        assert pop.trainer.optimizer is optimizers[index]
        assert pop.trainer.scheduler.get_last_lr() == [lr]
        assert pop.trainer.config.learning_rate == lr
        metrics = pop.trainer.learn(GROUPS)
        assert metrics["learning_rate"] == lr
    # every optimizer has its own moments, on no shared storage
    pointers = [{t.data_ptr() for t in adam_state(o)} for o in optimizers]
    assert all(pointers) and not (pointers[0] & pointers[1] or pointers[1] & pointers[2])


def test_temperature_and_beta_follow_the_active_member(tokenizer):
    torch.manual_seed(0)
    cfg = GRPOConfig(learning_rate=1e-3, lora_r=4, lora_alpha=8, beta=0.04)
    algo = GRPO(build(tokenizer), tokenizer, cfg, sampling=SAMPLING)
    pop = Population(algo, [hp(1e-3, beta=0.04), hp(1e-3, beta=0.1, temperature=0.7)], SAMPLING)
    pop.activate(1)
    assert algo.config.beta == 0.1 and algo.temperature == 0.7
    assert pop.sampling(1).temperature == 0.7
    assert pop.sampling(1).max_new_tokens == SAMPLING.max_new_tokens  # the rest is the run's
    pop.activate(0)
    assert algo.config.beta == 0.04 and algo.temperature == SAMPLING.temperature


def test_a_copy_owns_its_state_and_the_source_is_untouched_when_it_trains(tokenizer):
    pop = make_population(tokenizer)
    pop.activate(0)
    pop.trainer.learn(GROUPS)
    source_weights = live(pop)
    source_state = [t.clone() for t in adam_state(pop.members[0].own["optimizer"])]
    pop.copy(0, 2, hp(5e-4))
    pop.activate(2)
    assert all(torch.equal(a, b) for a, b in zip(live(pop), source_weights, strict=True))
    copied = adam_state(pop.members[2].own["optimizer"])
    assert all(torch.equal(a, b) for a, b in zip(copied, source_state, strict=True))
    assert not {t.data_ptr() for t in copied} & {
        t.data_ptr() for t in adam_state(pop.members[0].own["optimizer"])
    }
    assert pop.trainer.scheduler.get_last_lr() == [5e-4]  # the child's LR, not the parent's
    assert pop.members[2].own["optimizer"].param_groups[0]["lr"] == 5e-4
    pop.trainer.learn(GROUPS)  # the copy trains ...
    pop.activate(0)  # ... and the source is as it was
    assert all(torch.equal(a, b) for a, b in zip(live(pop), source_weights, strict=True))
    after = adam_state(pop.members[0].own["optimizer"])
    assert all(torch.equal(a, b) for a, b in zip(after, source_state, strict=True))
    assert pop.members[0].own["optimizer"].param_groups[0]["lr"] == 1e-3


def test_a_saved_population_loads_every_member_exactly(tokenizer, tmp_path):
    pop = make_population(tokenizer)
    for index in range(3):
        pop.activate(index)
        pop.trainer.learn(GROUPS)
        pop.members[index].fitness.append(0.1 * index)
    pop.copy(2, 0, hp(8e-3))
    assert [m.lineage_id for m in pop.members] == [3, 1, 2]
    pop.save(tmp_path / "step_000001", {"lineage": [{"step": 1}]})
    stored = [[w.clone() for w in m.weights] for m in pop.members]
    pop.activate(2)
    stored[2] = live(pop)

    other = make_population(tokenizer)
    state = other.load(tmp_path / "step_000001")
    assert state["lineage"] == [{"step": 1}]
    assert other.hyperparameters == pop.hyperparameters
    assert other.hyperparameters[0]["learning_rate"] == 8e-3
    for index in range(3):
        other.activate(index)
        pop.activate(index)
        assert all(torch.equal(a, b) for a, b in zip(live(other), live(pop), strict=True))
        for a, b in zip(
            adam_state(other.trainer.optimizer), adam_state(pop.trainer.optimizer), strict=True
        ):
            assert torch.equal(a, b)
        assert other.trainer.scheduler.get_last_lr() == pop.trainer.scheduler.get_last_lr()
    assert [m.fitness for m in other.members] == [[0.2], [0.1], [0.2]]
    assert [m.lineage_id for m in other.members] == [3, 1, 2]  # the draws resume as they were
    other.copy(1, 2, hp(1e-3))
    assert other.members[2].lineage_id == 4  # not an id a member already had
    assert best_member(tmp_path / "step_000001")[1] == 0  # 0.2 ties 2's: the lower index
    assert other.trainer.step == pop.trainer.step == 3
    assert (tmp_path / "step_000001" / "member_1" / "adapter").is_dir()  # plain checkpoints


def test_with_gae_a_copy_gets_its_parents_trained_critic(tokenizer):
    pop = make_population(tokenizer, lrs=(1e-3, 1e-3), credit="gae")
    critics = [m.own["critic"] for m in pop.members]
    assert critics[0] is not critics[1]
    for index in (0, 1):  # each critic fits its own episodes' returns
        pop.activate(index)
        assert pop.trainer.critic is critics[index]
        pop.trainer.learn(make_groups([[1, 0, 0], [0, 1, 1]], seed=index))
    heads = [c.head.state_dict() for c in critics]
    assert all(h["linear.weight"].abs().sum() > 0 for h in heads)  # trained off their zeros
    assert not torch.equal(heads[0]["linear.weight"], heads[1]["linear.weight"])
    parent = {k: v.clone() for k, v in heads[1].items()}
    parent_moments = [t.clone() for t in adam_state(critics[1].optimizer)]
    pop.copy(1, 0, hp(1e-3))
    assert all(torch.equal(heads[0][k], parent[k]) for k in parent)  # weight and bias
    assert heads[0]["linear.weight"].data_ptr() != heads[1]["linear.weight"].data_ptr()
    copied = adam_state(critics[0].optimizer)
    assert len(copied) == len(parent_moments) > 0
    assert all(torch.equal(a, b) for a, b in zip(copied, parent_moments, strict=True))
    pop.activate(0)
    assert pop.trainer.critic is critics[0]  # the copy trains its own critic, not the parent's


def test_a_copy_gets_a_fresh_lineage_id_and_a_member_kept_in_place_keeps_its_own(tokenizer):
    pop = make_population(tokenizer)
    assert [m.lineage_id for m in pop.members] == [0, 1, 2]
    pop.copy(1, 0, hp(1e-3))  # an unmutated copy: its parent's settings, its own draws
    pop.copy(1, 2, hp(2e-3))
    pop.copy(1, 1, hp(3e-3))  # member 1 stays itself with new settings
    assert [m.lineage_id for m in pop.members] == [3, 1, 4]
    assert pop.next_lineage_id == 5


def test_the_peak_lr_is_set_at_the_schedules_current_point(tokenizer):
    torch.manual_seed(0)
    cfg = GRPOConfig(learning_rate=1e-3, lora_r=4, lora_alpha=8, lr_scheduler="linear")
    algo = GRPO(build(tokenizer), tokenizer, cfg, sampling=SAMPLING, total_steps=4)
    algo.learn(GROUPS)  # one of 4 steps: the schedule is at 3/4
    set_peak_lr(algo.scheduler, 2e-3)
    assert algo.scheduler.get_last_lr() == pytest.approx([1.5e-3])
    assert algo.optimizer.param_groups[0]["lr"] == pytest.approx(1.5e-3)


def test_full_fine_tuning_cannot_be_a_population(tokenizer):
    cfg = GRPOConfig(learning_rate=1e-5, use_lora=False)
    algo = GRPO(build(tokenizer), tokenizer, cfg, sampling=SAMPLING)
    with pytest.raises(InvalidOptionError, match="use_lora true"):
        Population(algo, [hp(1e-5), hp(1e-5)], SAMPLING)
