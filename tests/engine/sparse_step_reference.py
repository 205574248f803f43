"""The float64 reference of the sparse engine's thresholded decode step, and the rules a path's
steps are judged by against it (`test_sparse_backend.test_native_decode_stack_gives_the_torch_layers_tokens`):
a decoder of the calibrated GGUF from the file alone (gguf-py), a recorder of what each step of
a path computed, and `judge_steps`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from llmlocal.engine.backends.sparse import SparseBackend
from llmlocal.engine.model.fast_decode import FastDecode

LAYER_PROJECTIONS = ("attn_qkv", "attn_output", "ffn_gate_up", "ffn_down")  # a layer's, in DecodeStack's order
STEP_TOLERANCE = 1e-4  # relative, the bound of tests/native/test_decode_stack_families.py (fp32 against float64)
UNDECIDED = 3e-4  # of an input row's RMS: where fp32 may put an input on either side of its threshold
MARGIN = 0.1  # nats
NOISE_MAX = 1.3  # tests/native/test_kernels_exact.py's MEAN_SQUARED_RATIO_MAX
LOGPROB_ERROR_FACTOR = 1.5


class Float64Decoder:
    """The calibrated GGUF's Llama decoder in float64, from the file alone: weights dequantized
    by gguf-py, shapes and thresholds from its metadata. `steps` runs decode steps on a given
    cache, each projection's input thresholded first (|x_j| <= t zeroed, as the kernels zero
    them)."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader, quants

        reader = GGUFReader(path)
        tensors = {t.name: t for t in reader.tensors}

        def meta(key: str) -> object:
            return reader.fields[key].contents()

        def f64(name: str) -> np.ndarray:
            t = tensors[name]
            return np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float64)

        self.n_layers, self.d = int(meta("llama.block_count")), int(meta("llama.embedding_length"))
        self.heads, self.kv_heads = int(meta("llama.attention.head_count")), int(meta("llama.attention.head_count_kv"))
        self.head_dim = self.d // self.heads
        self.rope_base, self.eps = float(meta("llama.rope.freq_base")), float(meta("llama.attention.layer_norm_rms_epsilon"))
        self.level = float(meta("llmlocal.sparsity.level"))
        table = np.array([[meta(f"llmlocal.sparsity.thresholds.{p}")[i] for p in LAYER_PROJECTIONS]
                          for i in range(self.n_layers)], dtype=np.float32)  # as the file stores them
        self.thresholds = table.reshape(-1).astype(np.float64)
        self.embed = f64("token_embd.weight")  # (vocab, d): the rows and the tied head
        self.out_norm = f64("output_norm.weight")
        self.layers = []
        for i in range(self.n_layers):
            b = f"blk.{i}."
            cat = lambda *names: np.ascontiguousarray(np.concatenate([f64(b + n + ".weight") for n in names]).T)  # noqa: E731
            self.layers.append((f64(b + "attn_norm.weight"), cat("attn_q", "attn_k", "attn_v"), cat("attn_output"),
                                f64(b + "ffn_norm.weight"), cat("ffn_gate", "ffn_up"), cat("ffn_down")))

    def rms(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def steps(self, tokens: np.ndarray, positions: np.ndarray, k_cache: list[np.ndarray], v_cache: list[np.ndarray],
              kept: np.ndarray) -> dict:
        """Decode steps s = 0..S-1, each on its own: tokens[s] at positions[s], attending to
        the cache's positions below it (per layer (P, kv heads, head dim)) and to its own k, v.
        Returns the final normed hidden states (S, d) and each step's new k, v per layer.

        Where an input lies within UNDECIDED of its threshold (fp32 and float64 may decide
        apart there), the step follows the path's count of kept inputs (``kept`` (S, 4 L)):
        among those inputs of a projection whose count differs, it flips the ones nearest the
        threshold. `unmatched` lists the (step, projection, difference) no such flip explains."""
        h_heads, kv, hd = self.heads, self.kv_heads, self.head_dim
        s_n = len(tokens)
        out = {"forced": 0, "undecided": 0, "unmatched": [], "kept": np.zeros_like(kept), "k": [], "v": []}

        def threshold(i: int, x: np.ndarray) -> np.ndarray:
            t = self.thresholds[i]
            keep = np.abs(x) > t
            dist = np.abs(np.abs(x) - t)
            near = dist <= UNDECIDED * np.sqrt(np.mean(x * x, axis=-1, keepdims=True))
            out["undecided"] += int(near.sum())
            diff = kept[:, i] - keep.sum(axis=-1)
            for s in np.flatnonzero(diff):
                flip = np.flatnonzero(near[s] & (keep[s] if diff[s] < 0 else ~keep[s]))
                if len(flip) < abs(diff[s]):
                    out["unmatched"].append((int(s), i, int(diff[s])))
                    continue
                keep[s, flip[np.argsort(dist[s, flip])[: abs(diff[s])]]] = diff[s] > 0
                out["forced"] += int(abs(diff[s]))
            out["kept"][:, i] = keep.sum(axis=-1)
            return np.where(keep, x, 0.0)

        inv = self.rope_base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
        angle = positions[:, None].astype(np.float64) * inv[None, :]
        cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]

        def rotate(x: np.ndarray) -> np.ndarray:  # interleaved pairs (2j, 2j + 1), llama.cpp's layout of a llama GGUF
            r = np.empty_like(x)
            r[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
            r[..., 1::2] = x[..., 0::2] * sin + x[..., 1::2] * cos
            return r

        group = np.arange(h_heads) // (h_heads // kv)
        past = np.arange(k_cache[0].shape[0])[None, :] < positions[:, None]  # (S, P)
        x = self.embed[tokens]
        for li, (attn_norm, w_qkv, w_o, ffn_norm, w_gu, w_down) in enumerate(self.layers):
            qkv = threshold(4 * li, self.rms(x, attn_norm)) @ w_qkv
            q = rotate(qkv[:, : h_heads * hd].reshape(s_n, h_heads, hd))
            k = rotate(qkv[:, h_heads * hd : (h_heads + kv) * hd].reshape(s_n, kv, hd))
            v = qkv[:, (h_heads + kv) * hd :].reshape(s_n, kv, hd)
            out["k"].append(k)
            out["v"].append(v)
            scores = np.where(past[:, None, :], np.einsum("shd,phd->shp", q, k_cache[li][:, group]), -np.inf) / np.sqrt(hd)
            own = np.einsum("shd,shd->sh", q, k[:, group]) / np.sqrt(hd)
            top = np.maximum(scores.max(axis=-1), own)
            p, p_own = np.exp(scores - top[..., None]), np.exp(own - top)
            att = (np.einsum("shp,phd->shd", p, v_cache[li][:, group]) + p_own[..., None] * v[:, group])
            att /= (p.sum(axis=-1) + p_own)[..., None]
            x = x + threshold(4 * li + 1, att.reshape(s_n, -1)) @ w_o
            gu = threshold(4 * li + 2, self.rms(x, ffn_norm)) @ w_gu
            gate, up = np.split(gu, 2, axis=-1)
            x = x + threshold(4 * li + 3, gate / (1.0 + np.exp(-gate)) * up) @ w_down
        out["h"] = self.rms(x, self.out_norm)
        return out


def layer_projections(backend: SparseBackend) -> list:
    """The projection modules layer by layer, each layer's in LAYER_PROJECTIONS' order (FastDecode's)."""
    projections = backend.projections()
    return [projections[p][i] for i in range(len(backend.runner.model.layers)) for p in LAYER_PROJECTIONS]


class DecodeRecorder:
    """While active, records every batch-1 decode step of the sparse engine (native or torch
    layers alike): its token, position, final normed hidden state and each projection's count of
    kept inputs (layer by layer in LAYER_PROJECTIONS' order), every step's logits, the
    request's K/V over its whole context as the cache holds them after its last step, and the
    backend's (skipped, total) weight counts at the start and before the first decode step."""

    def __init__(self, backend: SparseBackend) -> None:
        self.backend, self.runner, self.model = backend, backend.runner, backend.runner.model
        self.modules = layer_projections(backend)
        self.logits: list[np.ndarray] = []
        self.steps: list[tuple[int, int, np.ndarray, np.ndarray]] = []
        self.kv: list[tuple[np.ndarray, np.ndarray]] = []
        self.counts: list[tuple[int, int]] = []

    def __enter__(self) -> DecodeRecorder:
        execute, forward, stack = self.runner.execute, self.model.forward, self.backend._stack
        assert stack is not None

        def record_logits(*args: object, **kw: object) -> tuple[torch.Tensor, list]:
            logits, items = execute(*args, **kw)
            self.logits.append(logits.double().numpy().copy())
            return logits, items

        def record_step(input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: object) -> torch.Tensor:
            decode = input_ids.shape[0] == meta.num_decode == 1 and not meta.prefills
            if decode:
                if not self.steps:
                    self.counts.append(self.backend.counts())  # the prompt's share, counted by the torch layers
                native, skipped = stack.kept.copy(), [m.skipped for m in self.modules]
            hidden = forward(input_ids, positions, kv_caches, meta)
            if decode:
                torch_kept = [m.in_features - (m.skipped - s) // m.out_features for m, s in zip(self.modules, skipped)]
                kept = stack.kept - native if FastDecode.enabled else np.array(torch_kept)
                self.steps.append((int(input_ids[0]), int(positions[0]), hidden[0].double().numpy().copy(), kept))
                slots = meta.decode_slots[0, : int(meta.context_lens[0])]
                self.kv = [tuple(c.view(-1, *c.shape[2:])[slots].double().numpy() for c in layer) for layer in kv_caches]
            return hidden

        self.runner.execute, self.model.forward = record_logits, record_step
        self._forward = forward
        self.counts.append(self.backend.counts())
        return self

    def __exit__(self, *exc: object) -> None:
        del self.runner.execute  # the class's method again
        self.model.forward = self._forward


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def judge_steps(ref: Float64Decoder, record: DecodeRecorder, tokens: list[int], achieved: float, name: str) -> float:
    """The checks of test_native_decode_stack_gives_the_torch_layers_tokens on one path's
    decode steps; returns its mean |log-probability error| against the exact head."""
    assert len(record.steps) == len(tokens) - 1 and len(record.logits) == len(tokens)  # a prefill row, then a row a step
    step_tokens = np.array([s[0] for s in record.steps])
    positions = np.array([s[1] for s in record.steps])
    assert step_tokens.tolist() == tokens[:-1]
    assert (np.diff(positions) == 1).all() and positions[-1] == record.kv[0][0].shape[0] - 1
    kept = np.stack([s[3] for s in record.steps])
    got = ref.steps(step_tokens, positions, [k for k, _ in record.kv], [v for _, v in record.kv], kept)
    assert got["unmatched"] == [], f"{name}: kept counts no undecided input explains: {got['unmatched']}"
    np.testing.assert_array_equal(kept, got["kept"])
    # the share Stats reports: the prompt's counted skips, and each step's from the kept counts
    (s0, t0), (s1, t1) = record.counts
    shapes = np.array([w.shape for _, w_qkv, w_o, _, w_gu, w_down in ref.layers for w in (w_qkv, w_o, w_gu, w_down)])
    skipped = s1 - s0 + int(((shapes[:, 0] - kept) * shapes[:, 1]).sum())
    assert achieved == pytest.approx(skipped / (t1 - t0 + len(kept) * int(np.prod(shapes, axis=1).sum())), rel=1e-12)
    h, want = np.stack([s[2] for s in record.steps]), got["h"]
    err = (np.abs(h - want).max(axis=-1) / np.abs(want).max(axis=-1)).max()
    kv_err = max(np.abs(cache[positions] - new).max() / np.abs(new).max()
                 for layer, k_new, v_new in zip(record.kv, got["k"], got["v"]) for cache, new in zip(layer, (k_new, v_new)))
    # the log-probabilities: the path's logits come from the output head, which rounds its
    # input to int8 per block of 32 (llama.cpp's Q8_0 rule)
    w = ref.embed
    z = np.concatenate(record.logits[1:])  # row s: after step s, where tokens[s + 1] was picked
    z_exact = want @ w.T
    blocks = want.reshape(len(want), -1, 32)
    dx = np.abs(blocks).max(axis=-1, keepdims=True) / 127
    z_rounded = (np.rint(blocks / np.where(dx > 0, dx, 1.0)) * dx).reshape(want.shape) @ w.T
    rows = np.arange(len(z))
    lp_rounded = log_softmax(z_rounded)
    margin = lp_rounded.max(axis=-1) - lp_rounded[rows, tokens[1:]]
    e = np.repeat(np.abs(h).reshape(len(h), -1, 32).max(axis=-1), 32, axis=-1) / 127 * (0.5 + 2.0**-14)
    noise = float(((z - z_exact) ** 2 / ((e**2) @ (w**2).T / 3)).mean())
    lp_error = float(np.abs(log_softmax(z) - log_softmax(z_exact)).mean())
    print(f"\n{name}: {len(h)} steps, hidden {err:.1e}, k/v {kv_err:.1e} from float64; {got['forced']} of "
          f"{got['undecided']} undecided inputs follow the path; largest margin {margin.max():.3f}; "
          f"mean |log-prob error| {lp_error:.4f}, squared error / rounding variance {noise:.2f}")
    assert err <= STEP_TOLERANCE and kv_err <= STEP_TOLERANCE, (name, err, kv_err)
    assert margin.max() <= MARGIN, (name, np.flatnonzero(margin > MARGIN), margin.max())
    assert noise <= NOISE_MAX, (name, noise)
    return lp_error


