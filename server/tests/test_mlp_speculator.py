"""MLP speculators (IBM layout) as a drafter: the stages against the formula, loading and refusing checkpoints,
chains and trees, exact greedy and seeded outputs, and `--speculator` through the server's loader."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_medusa import run, run_together, speculative
from test_speculation import PROMPTS

from specula_server.models.config import ModelConfig
from specula_server.params import SamplingParams
from specula_server.speculation.drafters import PromptLookupDrafter
from specula_server.speculation.mlp_speculator import MLPSpeculatorDrafter
from specula_server.speculation.mlp_speculator_checkpoint import (
    MLPSpeculatorError,
    find_mlp_speculator,
    load_mlp_speculator,
)
from specula_testing.adapters import build_medusa_adapter, build_mlp_speculator
from specula_testing.worker import (
    BlockPool,
    assert_same_greedy_output,
    generate_alone,
    load_test_generator,
    make_spec,
    token_ids,
)


@pytest.fixture(scope="module")
def model_config(llama_dir):
    return ModelConfig.from_dir(llama_dir)


@pytest.fixture(scope="module")
def plain(llama_dir):
    return load_test_generator(llama_dir)


@pytest.fixture(scope="module")
def mlp_dir(llama_dir, tmp_path_factory):
    return build_mlp_speculator(llama_dir, tmp_path_factory.mktemp("mlp") / "untied", n_predict=3,
                                top_k_tokens_per_head=[3, 2, 2])


@pytest.fixture(scope="module")
def tied_dir(llama_dir, tmp_path_factory):
    return build_mlp_speculator(llama_dir, tmp_path_factory.mktemp("mlp") / "tied", n_predict=4, tie_weights=True,
                                scale_input=True, prefix="", seed=1)


# --- an independent reference, straight from the formula and the stored tensors ----------------------------


def reference_logits(directory: Path, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """fms-extras' stage formula in float64, written from scratch: [n_predict, n, vocab]."""
    config = json.loads((directory / "config.json").read_text())
    tensors = {}
    for file in directory.glob("*.safetensors"):
        tensors.update({k.removeprefix("speculator."): v.double() for k, v in load_file(file).items()})
    n_predict, inner = config["n_predict"], config["inner_dim"]
    tied = config["tie_weights"]
    state_weight = 0.5 ** (0.5 / n_predict)
    emb_weight = math.sqrt(1 - state_weight**2)  # fms-extras then multiplies by sqrt(inner / 2)
    state = hidden.double()
    if config["scale_input"]:
        state = state / torch.sqrt(state.pow(2).mean(-1, keepdim=True) + 1e-6) / math.sqrt(2)
    out = []
    for i in range(n_predict):
        shared = 0 if tied else i
        proj = tensors[f"proj.{min(i, 1) if tied else i}.weight"]
        z = tensors[f"emb.{shared}.weight"][tokens[:, i]] * (emb_weight * math.sqrt(inner / 2))
        state = state @ proj.T * state_weight + z
        state = state / torch.sqrt(state.pow(2).mean(-1, keepdim=True) + 1e-6)
        state = state * tensors[f"ln.{shared}.weight"] + tensors[f"ln.{shared}.bias"]
        state = 0.5 * state * (1 + torch.erf(state / math.sqrt(2)))  # exact GELU
        out.append(state @ tensors[f"head.{shared}.weight"].T)
    return torch.stack(out)


@pytest.mark.parametrize("which", ["untied", "tied"])
def test_stage_logits_match_the_formula(which, mlp_dir, tied_dir, model_config):
    directory = mlp_dir if which == "untied" else tied_dir
    speculator = load_mlp_speculator(directory, model_config)
    n_predict = speculator.n_predict
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(5, model_config.hidden_size, generator=generator) * 2
    tokens = torch.randint(0, model_config.vocab_size, (5, n_predict), generator=generator)
    got = speculator(hidden, tokens)
    assert got.shape == (n_predict, 5, model_config.vocab_size) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference_logits(directory, hidden, tokens), rtol=1e-4, atol=1e-4)


def test_state_and_embedding_weights(mlp_dir, model_config):
    config = load_mlp_speculator(mlp_dir, model_config).config
    assert config.state_weight == pytest.approx(0.5 ** (0.5 / 3))
    assert config.emb_weight == pytest.approx(math.sqrt((1 - 0.5 ** (1 / 3)) * 48 / 2))
    assert config.head_widths(1) == [1, 1, 1]  # a chain
    assert config.head_widths(2) == [2, 2, 2]  # capped by the width
    assert config.head_widths(8) == [3, 2, 2]  # the checkpoint's top_k_tokens_per_head


# --- loading --------------------------------------------------------------------------------------------------


def test_tied_checkpoint_shares_stage_weights(tied_dir, model_config):
    names = set(load_file(tied_dir / "model.safetensors"))
    assert names == {"emb.0.weight", "ln.0.weight", "ln.0.bias", "head.0.weight", "proj.0.weight", "proj.1.weight"}
    speculator = load_mlp_speculator(tied_dir, model_config)
    assert speculator.n_predict == 4 and speculator.config.tie_weights and speculator.config.scale_input
    assert speculator.emb.shape[0] == speculator.head.shape[0] == speculator.ln_weight.shape[0] == 1
    assert speculator.proj.shape[0] == 1  # proj.1 serves stages 1, 2 and 3


def test_sharded_checkpoint_in_half_precision(llama_dir, model_config, tmp_path):
    directory = build_mlp_speculator(llama_dir, tmp_path / "sharded", num_shards=2)
    assert (directory / "model.safetensors.index.json").is_file()
    speculator = load_mlp_speculator(directory, model_config, dtype=torch.bfloat16)
    assert speculator.emb.dtype == torch.bfloat16
    hidden = torch.randn(2, model_config.hidden_size)
    tokens = torch.randint(0, model_config.vocab_size, (2, 3))
    torch.testing.assert_close(speculator(hidden, tokens).double(), reference_logits(directory, hidden, tokens),
                               rtol=0.1, atol=0.5)  # bf16 weights and activations


def rewrite(directory: Path, target: Path, config_changes=None, drop=()) -> Path:
    shutil.copytree(directory, target)
    if config_changes is not None:
        config = json.loads((target / "config.json").read_text())
        for key, value in config_changes.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value
        (target / "config.json").write_text(json.dumps(config))
    if drop:
        tensors = load_file(target / "model.safetensors")
        save_file({k: v for k, v in tensors.items() if k not in drop}, target / "model.safetensors")
    return target


@pytest.mark.parametrize("changes,drop,message", [
    ({"emb_dim": 32}, (), r"emb_dim 32 is not the model's hidden size 64"),
    ({"vocab_size": 1000}, (), r"vocab_size 1000 is not the model's vocabulary size"),
    ({}, ("speculator.head.2.weight",), r"tensor speculator.head.2.weight is missing"),
    ({"n_predict": None}, (), r"config.json lacks n_predict"),
    ({"inner_dim": 32}, (), r"tensor speculator.emb.0.weight has shape \[\d+, 48\], expected \[\d+, 32\]"),
    ({"top_k_tokens_per_head": [2, 2]}, (), r"top_k_tokens_per_head \[2, 2\] must give a positive count for each "
                                            r"of the 3 stages"),
    ({"model_type": "llama"}, (), r"config.json has model_type 'llama', not 'mlp_speculator'"),
])
def test_bad_checkpoints_are_refused_clearly(mlp_dir, model_config, tmp_path, changes, drop, message):
    bad = rewrite(mlp_dir, tmp_path / "bad", changes, drop)
    with pytest.raises(MLPSpeculatorError, match=rf"MLP speculator `.*bad`: {message}"):
        load_mlp_speculator(bad, model_config)


def test_tied_checkpoint_without_proj1_is_refused(tied_dir, model_config, tmp_path):
    bad = rewrite(tied_dir, tmp_path / "bad", drop=("proj.1.weight",))
    with pytest.raises(MLPSpeculatorError, match=r"tensor proj.1.weight is missing \(a tie_weights checkpoint"):
        load_mlp_speculator(bad, model_config)


def test_wrong_model_is_refused_at_server_start(llama_dir, model_dirs, tmp_path):
    other = build_mlp_speculator(model_dirs["llama31"], tmp_path / "other", inner_dim=16)
    config = json.loads((other / "config.json").read_text())
    config["emb_dim"] = 32
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(MLPSpeculatorError, match="emb_dim 32 is not the model's hidden size 64"):
        load_test_generator(llama_dir, speculative_tokens=2, speculator=str(other))


# --- drafts ---------------------------------------------------------------------------------------------------


def fake_request(hidden, last_token, request_id=0, history=None):
    history = torch.tensor(history if history is not None else [1, 2, last_token])
    return SimpleNamespace(id=request_id, last_hidden=hidden, token_ids=history, num_tokens=history.numel(),
                           history=history)


def brute_force_tree(directory, hidden, last_token, widths, budget):
    """Every path of the full candidate tree (stage i offers its top widths[i] tokens after each node), scored
    with the reference, and the `budget` best nodes (score desc, shallower first)."""
    config = json.loads((directory / "config.json").read_text())
    n_predict = config["n_predict"]
    nodes = []  # (path of tokens, score)
    frontier = [((), 0.0)]
    for level in range(n_predict):
        next_frontier = []
        for path, score in frontier:
            tokens = torch.tensor([[last_token, *path] + [0] * (n_predict - 1 - len(path))])
            logits = reference_logits(directory, hidden.unsqueeze(0), tokens)[level, 0]
            top = torch.log_softmax(logits, -1).topk(widths[level])
            for lp, token in zip(top.values.tolist(), top.indices.tolist()):
                next_frontier.append(((*path, token), score + lp))
        nodes += next_frontier
        frontier = next_frontier
    nodes.sort(key=lambda node: (-node[1], len(node[0])))
    return [path for path, _ in nodes[:budget]]


def draft_paths(draft):
    paths = []
    for token, parent in zip(draft.tokens.tolist(), draft.node_parents()):
        paths.append((*(paths[parent] if parent >= 0 else ()), token))
    return paths


def test_chain_is_the_top1_of_each_stage(mlp_dir, model_config):
    speculator = load_mlp_speculator(mlp_dir, model_config)
    drafter = MLPSpeculatorDrafter(speculator, None, tree_width=1)
    hidden = torch.randn(2, model_config.hidden_size, generator=torch.Generator().manual_seed(5))
    requests = [fake_request(hidden[0], 17), fake_request(hidden[1], 40, request_id=1)]
    drafts = drafter.propose(requests, [5, 2])
    assert all(d.parents is None for d in drafts)  # chains
    assert [len(d) for d in drafts] == [3, 2]  # n_predict stages at most, and the budget
    for request, draft in zip(requests, drafts):
        tokens = [request.token_ids[-1].item()]
        for level in range(len(draft)):
            padded = torch.tensor([tokens + [0] * (3 - len(tokens))])
            logits = reference_logits(mlp_dir, request.last_hidden.unsqueeze(0), padded)[level, 0]
            tokens.append(int(logits.argmax()))
        assert draft.tokens.tolist() == tokens[1:]


@pytest.mark.parametrize("width,budgets", [(2, [4, 7, 1]), (8, [12, 3, 5])])
def test_tree_holds_the_best_nodes_parents_first(mlp_dir, model_config, width, budgets):
    speculator = load_mlp_speculator(mlp_dir, model_config)
    drafter = MLPSpeculatorDrafter(speculator, None, tree_width=width)
    hidden = torch.randn(3, model_config.hidden_size, generator=torch.Generator().manual_seed(11))
    requests = [fake_request(hidden[i], 30 + 7 * i, request_id=i) for i in range(3)]
    drafts = drafter.propose(requests, budgets)
    for request, draft, budget in zip(requests, drafts, budgets):
        assert len(draft) == budget
        parents = draft.node_parents()
        assert all(p < i for i, p in enumerate(parents))  # parents before children
        expected = brute_force_tree(mlp_dir, request.last_hidden, int(request.token_ids[-1]), drafter.widths, budget)
        assert draft_paths(draft) == expected
        assert all(len(set(draft.tokens[[j for j, p in enumerate(parents) if p == q]].tolist()))
                   == parents.count(q) for q in set(parents))  # siblings are distinct


def test_fallback_and_empty_budgets(mlp_dir, model_config):
    speculator = load_mlp_speculator(mlp_dir, model_config)
    drafter = MLPSpeculatorDrafter(speculator, PromptLookupDrafter(), tree_width=2)
    hidden = torch.randn(model_config.hidden_size)
    history = [5, 6, 7, 8, 5, 6]
    requests = [fake_request(None, 6, 0, history), fake_request(hidden, 6, 1, history),
                fake_request(hidden, 6, 2, history)]
    drafts = drafter.propose(requests, [3, 0, 4])
    assert drafts[0].tokens.tolist() == [7, 8, 5]  # no hidden state: prompt lookup
    assert len(drafts[1]) == 0 and len(drafts[2]) == 4
    assert [drafter.method_for(r) for r in requests] == ["ngram", "mlp", "mlp"]
    assert [len(d) for d in MLPSpeculatorDrafter(speculator, None).propose(requests, [3, 3, 0])] == [0, 3, 0]


# --- exact generation with the speculator served by `--speculator` ------------------------------------------


@pytest.mark.parametrize("which,width", [("untied", 1), ("untied", 3), ("tied", 2)])
def test_greedy_output_is_unchanged(llama_dir, plain, mlp_dir, tied_dir, which, width):
    directory = mlp_dir if which == "untied" else tied_dir
    generator = speculative(llama_dir, speculator=str(directory), draft_tree_width=width)
    assert generator.speculation.drafter.name == "mlp"
    drafted = 0
    for got in assert_same_greedy_output(plain, generator, PROMPTS, run, max_new_tokens=16):
        drafted += sum(o.num_drafted for o in got)
        assert {o.draft_method for o in got if o.num_drafted} == {"mlp"}
    assert drafted > 0


def test_mixed_batch_with_medusa_adapters_and_requests_without_drafts(llama_dir, plain, mlp_dir, tmp_path):
    """One batch: requests with their own Medusa heads, requests on the server's MLP speculator, and one that
    turned speculation off."""
    build_medusa_adapter(llama_dir, tmp_path / "heads", num_heads=2)
    generator = speculative(llama_dir, speculator=str(mlp_dir), draft_tree_width=2, adapter_dirs=(tmp_path,))
    generator.adapters.load("heads", "local")
    expected = {i: token_ids(run(plain, p, max_new_tokens=16)) for i, p in enumerate(PROMPTS)}
    pool = BlockPool(256, 16)
    specs = [make_spec(i, p, pool, max_new_tokens=16, lookahead=8, adapter_id="heads" if i == 1 else "",
                       speculative_tokens=0 if i == 3 else None) for i, p in enumerate(PROMPTS)]
    got = {i: [] for i in expected}
    methods = {i: set() for i in expected}
    for out in run_together(generator, specs):
        got[out.request_id] += [t.id for t in out.tokens]
        if out.num_drafted:
            methods[out.request_id].add(out.draft_method)
    assert got == expected
    assert methods == {0: {"mlp"}, 1: {"medusa"}, 2: {"mlp"}, 3: set()}


def test_seeded_sampling_matches_no_speculation(llama_dir, mlp_dir):
    plain_gen = load_test_generator(llama_dir)
    generator = speculative(llama_dir, speculator=str(mlp_dir), draft_tree_width=3)
    params = SamplingParams(temperature=0.8, top_k=20, seed=7, do_sample=True)
    for prompt in PROMPTS[:2]:
        expected = token_ids(run(plain_gen, prompt, max_new_tokens=12, sampling=params))
        assert token_ids(run(generator, prompt, max_new_tokens=12, sampling=params)) == expected


def test_speculator_from_the_hub_cache(llama_dir, plain, mlp_dir, tmp_path, monkeypatch):
    repo = tmp_path / "models--ibm-test--tiny-accelerator"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(mlp_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert find_mlp_speculator("ibm-test/tiny-accelerator", tmp_path) == repo / "snapshots" / commit
    assert find_mlp_speculator("ibm-test/not-cached", tmp_path) is None
    generator = speculative(llama_dir, speculator="ibm-test/tiny-accelerator", hub_cache=tmp_path)
    assert generator.speculation.drafter.name == "mlp"
    prompt = PROMPTS[0]
    assert token_ids(run(generator, prompt, max_new_tokens=8)) == token_ids(run(plain, prompt, max_new_tokens=8))


def test_other_speculators_are_refused_naming_what_is_accepted(llama_dir, tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "config.json").write_text(json.dumps({"model_type": "something_else"}))
    with pytest.raises(ValueError, match=r"--speculator .*junk: .*not an adapter.*MLP speculator"):
        load_test_generator(llama_dir, speculative_tokens=2, speculator=str(tmp_path / "junk"))


TP_SETTINGS = {"speculative_tokens": 3, "speculation_mode": "fixed", "draft_tree_width": 2}


def tp_requests(model_dir, speculator, group=None) -> list[list[int]]:
    """One prompt, greedy and seeded sampling, drafted with the MLP speculator."""
    generator = load_test_generator(model_dir, group=group, speculator=str(speculator), **TP_SETTINGS)
    sampled = SamplingParams(do_sample=True, temperature=0.8, top_p=0.9, seed=99)
    return [token_ids(generate_alone(generator, make_spec(j, PROMPTS[0], BlockPool(256, 16), max_new_tokens=12,
                                                          lookahead=8, sampling=sampling)))
            for j, sampling in enumerate([SamplingParams(), sampled])]


def _tp_rank_main(rank: int, port: int, model_dir, speculator, queue) -> None:
    from specula_server.distributed import init_distributed

    torch.set_num_threads(1)
    group = init_distributed(rank, 2, "127.0.0.1", port, torch.device("cpu"))
    try:
        queue.put((rank, tp_requests(model_dir, speculator, group)))
    finally:
        torch.distributed.destroy_process_group()


def test_two_ranks_draft_alike(llama_dir, mlp_dir):
    """Tensor parallel: every rank loads the speculator whole and reads the same full hidden state, so the
    ranks draft, verify and accept alike, and give one rank's tokens."""
    import torch.multiprocessing as mp
    from test_tensor_parallel import free_port

    expected = tp_requests(llama_dir, mlp_dir)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_tp_rank_main, args=(r, port, llama_dir, mlp_dir, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert results[0] == expected and results[1] == expected
