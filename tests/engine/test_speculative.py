"""Speculative decoding in the paged engine: greedy output identical to plain greedy decoding
on the starter model (a draft model, n-gram lookup, drafts always right, drafts always wrong),
the sampled distribution equal to the target's (chi-square on a tiny random model), and KV
blocks rolled back without leaks."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from llmlocal.engine import DoneEvent, Engine, Plan, Request, SamplingParams, TokenEvent
from llmlocal.engine.backends.base import Prompt
from llmlocal.engine.backends.paged import PagedBackend
from llmlocal.engine.core.sampling import filtered_probs
from llmlocal.engine.core.sequence import Sequence
from llmlocal.engine.spec.drafter import DraftModel, DraftRequest, Proposal, lookup
from llmlocal.models import resolve
from llmlocal.models.errors import LLMLocalError

PROMPTS = [
    "Write the numbers from 1 to 20, separated by commas.",
    "Repeat after me: the cat sat on the mat, the cat sat on the mat.",
    "What do bees make?",
]
MAX_TOKENS = 40
TARGET = Plan(backend="paged", weights="dense", dtype="fp32", n_ctx=512, max_batch=4)


def greedy(engine: Engine, prompt: str) -> DoneEvent:
    request = Request.chat([{"role": "user", "content": prompt}], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    done = None
    for event in engine.generate(request):
        if isinstance(event, DoneEvent):
            done = event
    assert done is not None
    return done


def token_ids(engine: Engine, prompt: str) -> list[int]:
    request = Request.chat([{"role": "user", "content": prompt}], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return [t for e in engine.generate(request) if isinstance(e, TokenEvent) for t in e.token_ids]


@pytest.fixture(scope="module")
def reference() -> dict[str, tuple[list[int], list[int]]]:
    """Plain greedy decoding of the fp32 target: prompt ids and completion ids per prompt."""
    with Engine.load(TARGET) as e:
        return {
            p: (e.prompt_ids(Request.chat([{"role": "user", "content": p}])), token_ids(e, p)) for p in PROMPTS
        }


def engine_with(drafter=None, **plan) -> Engine:
    model = resolve(None)
    p = TARGET.replace(**plan)
    return Engine(PagedBackend.load(model, p, drafter=drafter), model, p)


def assert_no_leaks(engine: Engine) -> None:
    backend = engine.backend
    assert isinstance(backend, PagedBackend)
    assert backend.blocks.num_used_blocks == 0
    drafter_blocks = getattr(backend.drafter, "blocks", None)
    if drafter_blocks is not None:
        assert drafter_blocks.num_used_blocks == 0
        drafter_blocks.check_invariants()
    backend.blocks.check_invariants()


@pytest.mark.parametrize("draft_k", [None, 2, 5])
def test_greedy_with_a_draft_model_equals_plain_greedy(reference, draft_k) -> None:
    # target: fp32 weights dequantized from the GGUF; draft: the same file as INT4
    with engine_with(draft="smollm2-135m", draft_k=draft_k) as e:
        for prompt, (_, expected) in reference.items():
            done = greedy(e, prompt)
            assert [t for t in token_ids(e, prompt)] == expected, prompt
            if draft_k is not None:
                assert done.stats.drafted_tokens and done.stats.accepted_tokens is not None
        assert_no_leaks(e)


def test_greedy_with_ngram_lookup_equals_plain_greedy(reference) -> None:
    with engine_with(draft="ngram", draft_k=4) as e:
        accepted = 0
        for prompt, (_, expected) in reference.items():
            assert token_ids(e, prompt) == expected, prompt
            accepted += greedy(e, prompt).stats.accepted_tokens or 0
        assert accepted > 0  # the counting and repeating prompts quote themselves
        assert_no_leaks(e)


def test_concurrent_greedy_requests_with_a_draft_model_equal_plain_greedy(reference) -> None:
    """Sequences drafted together (some checking looked-up continuations, some drafting token
    by token in the same passes) each get their plain greedy tokens."""
    results: dict[str, list[int]] = {}
    with engine_with(draft="smollm2-135m", draft_k=3) as e:
        threads = [threading.Thread(target=lambda p=p: results.__setitem__(p, token_ids(e, p))) for p in PROMPTS]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert e.backend.drafter.checked > 0
        assert_no_leaks(e)
    assert results == {p: expected for p, (_, expected) in reference.items()}


def test_a_draft_model_checking_a_lookup_proposes_what_it_would_draft(reference) -> None:
    """The draft checks a continuation found earlier in the text in one pass: the tokens it
    proposes are its own greedy drafts, found in fewer passes where the text repeats itself."""
    with engine_with(draft="smollm2-135m") as e:
        drafter = e.backend.drafter
        assert isinstance(drafter, DraftModel)
        greedy_params = SamplingParams(temperature=0)

        def propose(tokens: list[int], lookup_on: bool) -> list[int]:
            drafter.prompt_lookup = lookup_on
            seq = Sequence(7, list(tokens))
            proposal = drafter.propose([DraftRequest(seq, 3, greedy_params, None, room=3)])[0]
            passes[lookup_on] += drafter.last_passes
            return proposal.tokens

        passes = {False: 0, True: 0}
        checked = drafter.checked
        for prompt, completion in reference.values():
            text = prompt + completion
            for end in range(len(prompt) + 1, len(text)):
                own = propose(text[:end], False)
                assert propose(text[:end], True) == own, (prompt, end)
        assert drafter.checked - checked >= 10  # the counting and repeating prompts quote themselves
        assert passes[True] < passes[False]
        drafter.release(7)
        assert drafter.blocks.num_used_blocks == 0


def test_new_mirrors_sharing_a_prompt_compute_it_once(reference) -> None:
    """Two sequences proposed for together whose drafts lack the same long prompt: the draft
    computes it for the first, and the second drafts from the next step on, finding its blocks."""
    with engine_with(draft="smollm2-135m") as e:
        drafter = e.backend.drafter
        assert isinstance(drafter, DraftModel)
        greedy_params = SamplingParams(temperature=0)
        shared = [t for ids, _ in reference.values() for t in ids]  # three templated prompts: 5+ blocks
        a, b = Sequence(11, shared + [101, 102]), Sequence(12, shared + [201, 202, 203])
        size = drafter.blocks.block_size
        assert len(shared) >= 5 * size

        def propose(*seqs: Sequence) -> list[list[int]]:
            return [p.tokens for p in drafter.propose([DraftRequest(s, 2, greedy_params, None, room=2) for s in seqs])]

        first = propose(a, b)
        assert first[0] and first[1] == []  # b waits a step
        assert drafter.last_tokens <= a.num_tokens + 2
        assert propose(b)[0]
        own = b.num_tokens - len(shared) // size * size
        assert drafter.last_tokens <= own + 2  # b's own tokens, its shared blocks found
        drafter.release(11)
        drafter.release(12)
        assert drafter.blocks.num_used_blocks == 0


class Oracle:
    """Proposes the known greedy continuation (``wrong``: a different token at every place)."""

    name = "oracle"

    def __init__(self, sequences: list[list[int]], vocab: int, wrong: bool = False) -> None:
        self.sequences, self.vocab, self.wrong = sequences, vocab, wrong
        self.seconds = 0.0

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        out = []
        for r in requests:
            have = r.seq.token_ids
            full = next(s for s in self.sequences if s[: len(have)] == have)
            tokens = full[len(have) : len(have) + r.k]
            if self.wrong:
                tokens = [(t + 1) % self.vocab for t in tokens]
            out.append(Proposal(tokens, None))
        return out

    def release(self, seq_id: int) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize("wrong", [False, True])
def test_drafts_always_right_or_always_wrong_leave_the_output_unchanged(reference, wrong) -> None:
    sequences = [p + c for p, c in reference.values()]
    vocab = resolve(None).spec.vocab_size
    with engine_with(drafter=Oracle(sequences, vocab, wrong), draft_k=4) as e:
        for prompt, (_, expected) in reference.items():
            done = greedy(e, prompt)
            assert token_ids(e, prompt) == expected, prompt
            s = done.stats
            if wrong:
                # one token per step, as without drafts (the end-of-text step makes no token)
                assert s.accepted_tokens == 0 and s.target_steps in (s.completion_tokens, s.completion_tokens + 1)
            else:
                assert s.acceptance_rate == 1.0
                # the prefill step gives the first token; then every step keeps 4 drafts + 1
                assert s.target_steps is not None and s.target_steps <= 2 + (s.completion_tokens - 1) // 5
        assert_no_leaks(e)


def test_a_draft_with_another_tokenizer_is_refused(make_gguf) -> None:
    other = make_gguf(arch="llama", name="other-vocab.gguf")
    with pytest.raises(LLMLocalError, match="different tokenizer"):
        engine_with(draft=str(other))


def test_ngram_lookup_proposes_the_latest_continuation() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert lookup(tokens, 3) == [7, 8, 5]  # the latest earlier "1 2 3" continues with 7 8 5
    assert lookup(tokens, 1) == [7]
    assert lookup([4, 5, 6], 3) == []
    assert lookup([1, 2, 1, 2], 5) == [1, 2]  # the continuation runs up to the end


def test_no_drafts_while_requests_wait_to_start(reference) -> None:
    """Requests admitted a step at a time (a small token budget): while some wait to start, the
    ones running do not draft (the next steps are wider, and a draft's catch-up would be wasted);
    once all run, they do."""
    sequences = [p + c for p, c in reference.values()]
    seen: list[tuple[int, int]] = []  # (waiting, running) at each proposal

    class Recording(Oracle):
        def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
            seen.append((len(e.backend.scheduler.waiting), len(e.backend.scheduler.running)))
            return super().propose(requests)

    results: dict[str, list[int]] = {}
    with engine_with(drafter=Recording(sequences, resolve(None).spec.vocab_size), draft_k=4, max_batch_tokens=40) as e:
        threads = [threading.Thread(target=lambda p=p: results.__setitem__(p, token_ids(e, p))) for p in PROMPTS * 2]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert_no_leaks(e)
    assert results == {p: expected for p, (_, expected) in reference.items()}
    assert seen and all(waiting == 0 or running >= TARGET.max_batch for waiting, running in seen)


def test_a_prefill_computes_the_drafts_blocks_too(reference) -> None:
    """`Engine.prefill` (a chat's message prefilled while it is typed) leaves the prompt's full
    blocks in the draft's prefix cache as well as the target's, so the request's first proposal
    does not catch up on them; the request then gives plain greedy's tokens."""
    prompt = PROMPTS[0]
    request = Request.chat([{"role": "user", "content": prompt}], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    with engine_with(draft="smollm2-135m", draft_k=3) as e:
        drafter = e.backend.drafter
        ids = e.prompt_ids(request)
        assert len(drafter.blocks.uncached_prefix(ids)) == len(ids) // drafter.runner.block_size > 0
        assert e.prefill(request) > 0
        assert drafter.blocks.uncached_prefix(ids) == []  # every full block of the prompt, in the draft's pool
        assert token_ids(e, prompt) == reference[prompt][1]
        assert_no_leaks(e)


# ---- the sampled distribution -------------------------------------------------------------

VOCAB = 8


def tiny_model(directory: Path, seed: int) -> None:
    """A random 8-token model with a tokenizer (no end-of-generation token)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_llama import write_checkpoint
    from tokenizers import Tokenizer, models

    write_checkpoint(directory, seed=seed, vocab_size=VOCAB)
    vocab = {chr(ord("a") + i): i for i in range(VOCAB)}
    Tokenizer(models.WordLevel(vocab=vocab, unk_token="a")).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({}))


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("spec")
    tiny_model(root / "target", seed=0)
    tiny_model(root / "draft", seed=1)
    return root / "target", root / "draft"


def exact_pair_distribution(backend: PagedBackend, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """(V, V) target probability of the 2nd and 3rd generated tokens (summed over the 1st)."""
    def dist(tokens: list[int]) -> torch.Tensor:
        lp = torch.from_numpy(backend.log_probs(tokens + [0]))[-1]
        return filtered_probs(lp, params)

    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    p1 = dist(prompt)
    for x1 in range(VOCAB):
        if p1[x1] == 0:
            continue
        p2 = dist(prompt + [x1])
        for x2 in range(VOCAB):
            if p2[x2] == 0:
                continue
            joint[x2] += float(p1[x1]) * float(p2[x2]) * dist(prompt + [x1, x2]).double()
    return joint


def chi_square_p_value(observed: torch.Tensor, expected_p: torch.Tensor) -> float:
    n = float(observed.sum())
    exp = expected_p.flatten() * n
    obs = observed.flatten().double()
    big = exp >= 5  # pool the rare cells into one
    e = torch.cat([exp[big], exp[~big].sum().reshape(1)])
    o = torch.cat([obs[big], obs[~big].sum().reshape(1)])
    keep = e > 0
    stat = float(((o[keep] - e[keep]) ** 2 / e[keep]).sum())
    df = int(keep.sum()) - 1
    # chi-square survival function: the regularized upper incomplete gamma Q(df / 2, stat / 2)
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


# A prompt that repeats itself: after any first token x but 5 its last two tokens (5, x)
# occurred before, so the draft model checks a looked-up continuation.
REPEATING = [2, 6, 1, 5, 0, 5, 1, 5, 2, 5, 3, 5, 4, 5, 6, 5, 7, 2, 6, 1, 5]


@pytest.mark.parametrize(
    "temperature,top_p,prompt",
    [(0.7, 1.0, [1, 5, 2]), (1.0, 1.0, [1, 5, 2]), (0.7, 0.8, [1, 5, 2]), (1.0, 0.8, [1, 5, 2]),
     (0.7, 1.0, REPEATING), (1.0, 0.8, REPEATING)],
)
def test_speculative_samples_follow_the_target_distribution(tiny_pair, temperature, top_p, prompt) -> None:
    target, draft = tiny_pair
    plan = Plan(model=str(target), backend="paged", dtype="fp32", n_ctx=64, draft=str(draft), draft_k=2, max_batch=16)
    backend = PagedBackend.load(resolve(str(target)), plan)
    try:
        # top_k 0 and min_p 0: only temperature and top-p shape the distribution
        base = SamplingParams(temperature=temperature, top_p=top_p, top_k=0, min_p=0.0, max_tokens=3, n=64)
        counts = torch.zeros(VOCAB, VOCAB)
        lock = threading.Lock()
        drafted = accepted = 0

        def run(seed: int) -> None:
            nonlocal drafted, accepted
            params = SamplingParams(**{**base.__dict__, "seed": seed})
            tokens: dict[int, list[int]] = {}
            for event in backend.generate(Request(prompt="x", sampling=params), Prompt(prompt, len(prompt)), threading.Event()):
                if isinstance(event, TokenEvent):
                    tokens.setdefault(event.index, []).extend(event.token_ids)
                elif isinstance(event, DoneEvent):
                    with lock:
                        drafted += event.stats.drafted_tokens or 0
                        accepted += event.stats.accepted_tokens or 0
            with lock:
                for seq in tokens.values():
                    counts[seq[1], seq[2]] += 1

        threads = [threading.Thread(target=run, args=(1000 * i,)) for i in range(48)]  # 3072 samples
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert counts.sum() == 48 * 64
        assert drafted > 0 and 0 < accepted < drafted  # both branches of the rule ran
        if prompt == REPEATING:
            assert backend.drafter.checked > 0
        expected = exact_pair_distribution(backend, prompt, base)
        assert chi_square_p_value(counts, expected) > 0.001
        assert backend.blocks.num_used_blocks == 0
    finally:
        backend.close()
