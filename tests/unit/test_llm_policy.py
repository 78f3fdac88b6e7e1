"""The LLM scheduling policy (frugaltune/scheduling/llm_policy.py) on a tiny random llama with the real SmolLM2
tokenizer: never an invalid job, the model skipped only for one-job windows, batched lockstep simulation, the
named fallback when the model cannot load.

Run with `pytest tests/unit/test_llm_policy.py` (about 10 s: a few hundred forwards of a 2-layer model).
"""

from __future__ import annotations

import pytest

from frugaltune.scheduling import SJF, simulate, synthetic_workload
from frugaltune.scheduling.llm_policy import LLMPolicy, load_llm_policy
from frugaltune.scheduling.policies import ScorePolicy
from frugaltune.scheduling.simulator import Simulator, simulate_batch
from frugaltune.methods import get as method_named

WINDOW = 5


@pytest.fixture(scope="module")
def workload():
    # Busy enough that most decisions see several jobs: arrivals every ~20 s on 16 processors.
    return synthetic_workload(90, max_procs=16, seed=2, mean_interarrival=20.0)


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return load_llm_policy(tiny_model_dir, None, name="tiny", threads=1)


def test_the_base_model_loads_as_an_llm_policy_with_its_chat_template(policy):
    assert isinstance(policy, LLMPolicy) and policy.name == "tiny" and policy.templated


def test_every_answer_is_a_visible_job_and_only_one_job_windows_skip_the_model(workload, tiny_model_dir):
    policy = load_llm_policy(tiny_model_dir, None, threads=1)
    sim = Simulator(workload.jobs[:40], 16, window=WINDOW)
    decisions = multi = 0
    while (state := sim.next_decision()) is not None:
        job = policy.choose(state)
        assert any(job is visible for visible in state.queue)
        decisions += 1
        multi += len(state.queue) > 1
        sim.commit(job)
    assert multi > 5  # the test exercised the model, not only forced choices
    stats = policy.stats()
    assert stats["decisions"] == decisions and stats["model_calls"] == multi
    assert stats["decisions_per_s"] > 0 and stats["seconds"] > 0


def test_lockstep_batches_schedule_every_sequence_like_simulate(workload, policy):
    sequences = [workload.jobs[0:30], workload.jobs[30:60], workload.jobs[60:90]]
    # A heuristic has no choose_many: the batch driver asks it state by state; schedules must match exactly.
    for got, jobs in zip(simulate_batch(sequences, 16, SJF, window=WINDOW), sequences):
        assert got.schedule() == simulate(jobs, 16, SJF, window=WINDOW).schedule()
    before = policy.stats()["decisions"]
    results = simulate_batch(sequences, 16, policy, window=WINDOW)
    assert [r.policy for r in results] == ["tiny"] * 3
    assert all(len(r.schedule()) == 30 for r in results)  # every job ran: no invalid answer stopped a sequence
    assert policy.stats()["decisions"] - before == sum(r.decisions for r in results)


def test_a_model_that_cannot_load_gives_the_named_fallback(tmp_path, tiny_model_dir, capsys):
    missing = tmp_path / "no_adapter"
    policy = load_llm_policy(tiny_model_dir, missing, fallback="F1")
    assert isinstance(policy, ScorePolicy) and policy.name == "F1 (fallback: model not loaded)"
    assert "fallback heuristic F1" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="no_adapter"):
        load_llm_policy(tiny_model_dir, missing)
    with pytest.raises(ValueError, match="scheduling.llm.fallback"):
        load_llm_policy(tiny_model_dir, missing, fallback="LIFO")


def test_a_merged_adapter_chooses_as_the_unmerged_one_and_bf16_weights_stay_close(workload, tiny_model_dir,
                                                                                   smol_tokenizer):
    import torch
    from peft import PeftModel

    from frugaltune.config import parse_params
    from frugaltune.generation import choose, prompt_ids
    from frugaltune.scheduling.llm_policy import for_inference
    from frugaltune.scheduling.sft import encode_state, job_labels
    from frugaltune.training.methods import prepare_model

    model = prepare_model(tiny_model_dir, [], smol_tokenizer.pad_token_id, 0, method_named("lora"), parse_params({}).train.lora,
                          task="causal_lm")
    with torch.no_grad():  # a fresh adapter's B is zero: give it an effect that a wrong merge would show
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    model.eval()
    sim = Simulator(workload.jobs[:40], 16, window=WINDOW)
    prompts, options = [], []
    while (state := sim.next_decision()) is not None:
        if len(state.queue) > 1:
            prompts.append(prompt_ids(smol_tokenizer, encode_state(state), None, True))
            options.append(job_labels(len(state.queue)))
        sim.commit(state.queue[0])
    assert len(prompts) > 5
    best, scores = choose(model, smol_tokenizer, prompts, options)

    merged = for_inference(model)
    assert not isinstance(merged, PeftModel) and not any("lora_" in n for n, _ in merged.named_parameters())
    merged_best, merged_scores = choose(merged, smol_tokenizer, prompts, options)
    assert merged_best == best
    assert [s for row in merged_scores for s in row] == pytest.approx([s for row in scores for s in row], abs=1e-4)

    half = for_inference(merged, bf16=True)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    _, half_scores = choose(half, smol_tokenizer, prompts, options)
    # bf16 keeps ~3 significant digits: log-probabilities near -10.8 move by hundredths, not more
    assert [s for row in half_scores for s in row] == pytest.approx([s for row in scores for s in row], abs=0.1)
