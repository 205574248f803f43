"""QMatrix: GGUF quantized types in their own bytes, int8 activations (csrc/qmat*.c, qlayout.py).

Every type against two references: gguf-py's dequantization (the decoded codes and factors
rebuild the file's weights bit for bit) and the numpy emulation of the kernels' arithmetic
(int8 activations per 32 inputs, integer sums per group); on every ISA this machine has, in
both layouts (column runs, and quads of columns), batch 1-64, thresholds, odd shapes. The
exact float64 product, with a bound derived from the activations' rounding, is the reference of
test_kernels_exact.py; the emulation here is the tighter check of the same arithmetic.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import quants
from gguf.constants import GGMLQuantizationType
from llmlocal.native.cpu import kernels, runtime
from llmlocal.native.cpu import qlayout as ql
from llmlocal.native.cpu.linear import QuantLinear, quantize_dequantize
from qmat_cases import gguf_blocks

TYPES = sorted(ql.FORMATS)
NAMES = [ql.FORMATS[t].name for t in TYPES]


@pytest.mark.parametrize("qtype", [t for t in TYPES if t != ql.Q8_0], ids=[n for n in NAMES if n != "Q8_0"])
def test_native_codes_match_numpy(qtype: int) -> None:
    raw = gguf_blocks(qtype, 37, 768, seed=qtype)
    native, ref = ql.decode(raw, qtype), ql.decode(raw, qtype, native=False)
    np.testing.assert_array_equal(native.codes, ref.codes)
    assert native.codes.dtype == np.uint8 and native.codes.flags.c_contiguous


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES)
def test_decode_matches_gguf_dequantize(qtype: int) -> None:
    f = ql.FORMATS[qtype]
    for n, k in [(7, f.block_values), (40, 2 * f.block_values * 3)]:
        raw = gguf_blocks(qtype, n, k)
        ours = ql.decode(raw, qtype).dequantize()
        ref = quants.dequantize(raw, GGMLQuantizationType(qtype)).reshape(n, k)
        np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("interleaved", [False, True], ids=["columns", "quads"])
@pytest.mark.parametrize("qtype", TYPES, ids=NAMES)
def test_gemv_matches_reference(isa: str, qtype: int, interleaved: bool) -> None:
    f = ql.FORMATS[qtype]
    rng = np.random.default_rng(qtype)
    for n, k in [(33, 256), (96, 512), (130, 768)]:  # odd row counts: padded chunks
        if k % f.block_values:
            continue
        c = ql.decode(gguf_blocks(qtype, n, k, seed=n), qtype)
        p = ql.pack(c, interleaved)
        m = kernels().QMatrix(qtype, p.codes, p.d, p.m, p.sc, p.mn, n, k, interleaved)
        for batch in (1, 2, 3, 8, 13, 64):  # more than 8 rows: the prefill-shaped loop
            for threshold in (None, 0.6):
                x = rng.standard_normal((batch, k)).astype(np.float32)
                x[:, :32] = 0.0  # a whole block of zeros: dx = 0
                y = np.full((batch, n), np.nan, dtype=np.float32)
                kept = m.gemv(x, y, batch, k, n, 0.0 if threshold is None else threshold, threshold is None, None)
                ref = ql.reference_gemv(c, x, threshold)
                scale = np.abs(ref).max()
                np.testing.assert_allclose(y, ref, rtol=0, atol=2e-5 * scale, err_msg=f"{n}x{k} batch {batch}")
                if threshold is None:
                    assert kept == k
                elif not interleaved:  # the columns read: those some row keeps
                    assert kept == int((np.abs(x) > threshold).any(axis=0).sum())


@pytest.mark.parametrize("interleaved", [False, True], ids=["columns", "quads"])
@pytest.mark.parametrize("qtype", TYPES, ids=NAMES)
def test_vnni_kernels_give_the_avx2_kernels_floats(isa: str, qtype: int, interleaved: bool) -> None:
    """Where the CPU has VNNI, its kernels (vpdpbusd, the sub-block scales applied to int32
    sums) compute bit for bit what the AVX2 kernel computes (int16 sums, scales in the
    widening): the same integers, then the same float operations per row. (The AVX-512
    variants' decode steps on the column layout compute the interleaved kernels' floats
    instead: the next test.)"""
    vnni = runtime.qmat_kernel()
    if "vnni" not in vnni:
        pytest.skip(f"the {isa} path runs no VNNI kernel on this CPU ({vnni})")
    f = ql.FORMATS[qtype]
    rng = np.random.default_rng(qtype + 1)
    n, k = 70, 1024 if f.dgroup == 256 else 352
    c = ql.decode(gguf_blocks(qtype, n, k, seed=5), qtype)
    p = ql.pack(c, interleaved)
    m = kernels().QMatrix(qtype, p.codes, p.d, p.m, p.sc, p.mn, n, k, interleaved)
    batches = (1, 2, 3, 4, 8, 13, 40, 64)  # prefill: 40 = two AMX blocks of 16 rows (where present) and 8 more
    if not interleaved and vnni.startswith("avx512"):
        batches = (13, 40, 64) if vnni == "avx512vnni" else ()
        if not batches:
            pytest.skip("the AMX variant runs the column layout as the interleaved kernels do (the next test)")
    for batch in batches:
        for threshold in (None, 0.6):
            x = (4 * rng.standard_normal((batch, k))).astype(np.float32)  # large |qx|: no int16 slack
            ys = []
            for on in (True, False):
                runtime.set_qmat_vnni(on)
                try:
                    y = np.full((batch, n), np.nan, dtype=np.float32)
                    m.gemv(x, y, batch, k, n, 0.0 if threshold is None else threshold, threshold is None, None)
                finally:
                    runtime.set_qmat_vnni(True)
                ys.append(y)
            assert runtime.qmat_kernel() == vnni
            np.testing.assert_array_equal(ys[0], ys[1], err_msg=f"{vnni} vs avx2, batch {batch}")


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES)
def test_decode_rows_equal_each_row_alone(qtype: int) -> None:
    """Each row of a call of 2 to 9 rows (the decode passes of a verification or a batch, and
    the first calls past them), or of a prompt's 40 or 64 (the prefill passes), gives bit for
    bit the floats of that row alone, on one thread and on two (a thread's share of the rows is
    whole chunks)."""
    f = ql.FORMATS[qtype]
    rng = np.random.default_rng(qtype + 7)
    n, k = 96, 1024 if f.dgroup == 256 else 352
    p = ql.pack(ql.decode(gguf_blocks(qtype, n, k, seed=9), qtype), True)
    m = kernels().QMatrix(qtype, p.codes, p.d, p.m, p.sc, p.mn, n, k, True)
    x = (4 * rng.standard_normal((64, k))).astype(np.float32)  # large |qx|: no int16 slack

    def gemv(rows: np.ndarray) -> np.ndarray:
        y = np.full((len(rows), n), np.nan, dtype=np.float32)
        m.gemv(np.ascontiguousarray(rows), y, len(rows), k, n, 0.0, True, None)
        return y

    alone = np.concatenate([gemv(x[r : r + 1]) for r in range(len(x))])
    before = runtime.num_threads()
    try:
        for threads in (1, 2):
            runtime.set_num_threads(threads)
            for batch in (*range(2, 10), 40, 64):
                np.testing.assert_array_equal(gemv(x[:batch]), alone[:batch], err_msg=f"{threads} threads, batch {batch}")
    finally:
        runtime.set_num_threads(before)


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES)
def test_column_decode_gives_the_interleaved_kernels_floats(qtype: int) -> None:
    """On AVX-512 with VNNI a decode step on the column layout (sparse files: zeroed inputs'
    columns are not read) applies the factors as the interleaved kernels do, so a call over
    all of K (threads split by rows) gives bit for bit their floats for the same thresholded
    x, and the same columns kept; split by groups of columns, the threads' partial sums are
    added, which rounds differently (close). With AMX, prefill-sized calls (every column in its
    slot, split by rows) take the interleaved kernels' path, the quads read from the columns'
    runs: their floats too."""
    if not runtime.qmat_kernel().startswith("avx512vnni"):
        pytest.skip(f"no 512-bit column kernel on this CPU ({runtime.qmat_kernel()})")
    f = ql.FORMATS[qtype]
    rng = np.random.default_rng(qtype + 3)
    c = ql.decode(gguf_blocks(qtype, 100, 2048, seed=11), qtype)  # 100 rows: a padded chunk
    n, k = c.codes.shape
    ms = {}
    for il in (False, True):
        p = ql.pack(c, il)
        ms[il] = kernels().QMatrix(qtype, p.codes, p.d, p.m, p.sc, p.mn, n, k, il)
    K = kernels()
    try:
        for split in (0, 1):
            K.set_split_mode(split)
            amx = runtime.qmat_kernel() == "avx512vnni-amx"
            for batch in (1, 2, 3, 5, 8, *((13, 40, 64) if amx else ())):
                for threshold in (None, 0.3, 1.2):
                    x = (2 * rng.standard_normal((batch, k))).astype(np.float32)
                    x[0, : 2 * f.group] = 0.0  # whole groups of zeros: nothing kept there
                    ys = {}
                    for il in (False, True):
                        ys[il] = np.full((batch, n), np.nan, dtype=np.float32)
                        kept = ms[il].gemv(x, ys[il], batch, k, n, 0.0 if threshold is None else threshold,
                                           threshold is None, None)
                        if not il and threshold is not None:
                            assert kept == int((np.abs(x) > threshold).any(axis=0).sum())
                    msg = f"split {split}, batch {batch}, threshold {threshold}"
                    if split == 0 or batch > 8:
                        np.testing.assert_array_equal(ys[False], ys[True], err_msg=msg)
                    else:
                        scale = np.abs(ys[True]).max()
                        np.testing.assert_allclose(ys[False], ys[True], rtol=0, atol=1e-6 * scale, err_msg=msg)
    finally:
        K.set_split_mode(2)


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES)
def test_amx_prefill_gives_the_vnni_kernels_floats(qtype: int) -> None:
    """Where the CPU has AMX, prefill's group sums come from tile multiplies (blocks of 16 rows
    of x, the rest through the VNNI passes): bit for bit what the VNNI kernel computes."""
    if runtime.qmat_kernel() != "avx512vnni-amx":
        pytest.skip(f"no AMX prefill on this CPU or build ({runtime.qmat_kernel()})")
    f = ql.FORMATS[qtype]
    rng = np.random.default_rng(qtype + 7)
    n, k = 96, 1024 if f.dgroup == 256 else 352
    c = ql.decode(gguf_blocks(qtype, n, k, seed=9), qtype)
    p = ql.pack(c, interleaved=True)
    m = kernels().QMatrix(qtype, p.codes, p.d, p.m, p.sc, p.mn, n, k, True)
    for batch in (16, 21, 40, 64):
        x = (4 * rng.standard_normal((batch, k))).astype(np.float32)
        ys = {}
        for amx in (True, False):
            runtime.set_qmat_amx(amx)
            try:
                assert runtime.qmat_kernel() == ("avx512vnni-amx" if amx else "avx512vnni")
                ys[amx] = np.full((batch, n), np.nan, dtype=np.float32)
                m.gemv(x, ys[amx], batch, k, n, 0.0, True, None)
            finally:
                runtime.set_qmat_amx(True)
        np.testing.assert_array_equal(ys[True], ys[False], err_msg=f"amx vs avx512vnni, batch {batch}")


@pytest.mark.parametrize("interleaved", [False, True], ids=["columns", "quads"])
@pytest.mark.parametrize("qtype", TYPES, ids=NAMES)
def test_dequantize_kernel_is_exact(qtype: int, interleaved: bool) -> None:
    n, k = 70, 512
    c = ql.decode(gguf_blocks(qtype, n, k), qtype)
    p = ql.pack(c, interleaved)
    m = kernels().QMatrix(qtype, p.codes, p.d, p.m, p.sc, p.mn, n, k, interleaved)
    out = np.zeros((k, p.npad), dtype=np.float32)
    m.dequantize(out, 0, p.npad, p.npad)
    np.testing.assert_array_equal(out[:, :n].T, c.dequantize())


def test_stacked_types_and_prefill_paths() -> None:
    """A fused projection whose parts differ in type (q, k Q4_K; v Q6_K): one matrix per run of
    a type, outputs stacked; 8+ rows in chunks; 48+ rows through the kernel (quads, and columns
    where the kernel runs on AMX tiles) or as a GEMM on the dequantized weight (columns
    elsewhere), all on the activations rounded as the GEMV rounds them."""
    import torch

    k = 512
    parts = [ql.decode(gguf_blocks(t, n, k, seed=n), t) for t, n in [(ql.Q4_K, 64), (ql.Q4_K, 32), (ql.Q6_K, 32)]]
    w = np.concatenate([p.dequantize() for p in parts])
    x = torch.randn(50, k)
    ref = ql.reference_gemv(ql.QuantCodes.concat(parts[:2]), x[:11].numpy())
    ref = np.concatenate([ref, ql.reference_gemv(parts[2], x[:11].numpy())], axis=1)
    for interleaved in (True, False):
        lin = QuantLinear(parts, interleaved=interleaved)
        assert lin.qtypes == [ql.Q4_K, ql.Q6_K] and lin.out_features == 128
        assert lin.prefill_matmul is not (interleaved or runtime.qmat_kernel() == "avx512vnni-amx")
        np.testing.assert_allclose(lin(x[:11].contiguous()).numpy(), ref, atol=2e-5 * np.abs(ref).max())
        full = lin(x)  # 50 rows
        np.testing.assert_allclose(full[:11].numpy(), ref, atol=2e-5 * np.abs(ref).max())
        want = quantize_dequantize(x).numpy() @ w.T
        np.testing.assert_allclose(full.numpy(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        if interleaved:  # the kernel: every row the same numbers as alone (rows in full and partial passes)
            for r in (3, 41, 49):
                np.testing.assert_array_equal(full[r : r + 1].numpy(), lin(x[r : r + 1].contiguous()).numpy())


def test_qmatrix_refuses_wrong_arrays() -> None:
    c = ql.decode(gguf_blocks(ql.Q4_K, 32, 256), ql.Q4_K)
    p = ql.pack(c)
    with pytest.raises(ValueError, match="takes m"):
        kernels().QMatrix(ql.Q4_K, p.codes, p.d, None, p.sc, p.mn, 32, 256)
    with pytest.raises(ValueError, match="no native kernel"):
        kernels().QMatrix(99, p.codes, p.d, p.m, p.sc, p.mn, 32, 256)
    with pytest.raises(ValueError, match="holds"):
        kernels().QMatrix(ql.Q4_K, p.codes[:10], p.d, p.m, p.sc, p.mn, 32, 256)


@pytest.mark.parametrize("interleaved", [False, True], ids=["columns", "quads"])
@pytest.mark.parametrize("qtype", TYPES, ids=NAMES)
def test_packed_matrix_holds_the_files_bytes(qtype: int, interleaved: bool) -> None:
    """A decode step reads no more than the file holds: the packed arrays of a tensor whose row
    count is a multiple of 32 (no padding) take exactly its GGUF bytes."""
    raw = gguf_blocks(qtype, 64, 512)
    p = ql.pack(ql.decode(raw, qtype), interleaved)
    assert p.nbytes == raw.nbytes


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES)
def test_native_packing_matches_numpy(qtype: int) -> None:
    """The C packer of the interleaved layout (every load) writes the numpy reference's bytes,
    padding rows included."""
    f = ql.FORMATS[qtype]
    c = ql.decode(gguf_blocks(qtype, 45, 2 * f.block_values), qtype)
    native, ref = ql.pack(c, interleaved=True), ql.pack(c, interleaved=True, native=False)
    np.testing.assert_array_equal(native.codes, ref.codes)


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES)
def test_packing_rows_from_the_file_matches_decoding_first(qtype: int) -> None:
    """The loader's one-pass packer (the file's rows straight into the interleaved arrays)
    writes what decoding, permuting rows, stacking and packing write: two tensors of one type
    stacked, the first with its rows permuted (RoPE), the second in order, 45 + 21 rows (a
    padded last chunk)."""
    f = ql.FORMATS[qtype]
    k = 2 * f.dgroup if f.dgroup == 256 else 96
    a, b = gguf_blocks(qtype, 45, k, seed=1), gguf_blocks(qtype, 21, k, seed=2)
    perm = np.random.default_rng(qtype).permutation(45)
    rows = [ql.QuantRows(qtype, a, perm), ql.QuantRows(qtype, b)]
    assert rows[0].shape == (45, k)
    got = ql.pack_rows(rows)
    want = ql.pack(ql.QuantCodes.concat([ql.decode(a[perm], qtype), ql.decode(b, qtype)]), interleaved=True)
    assert got is not None and (got.n, got.k, got.interleaved) == (66, k, True)
    for name in ("codes", "d", "m", "sc", "mn"):
        g, w = getattr(got, name), getattr(want, name)
        assert (g is None) == (w is None), name
        if g is not None:
            assert g.shape == w.shape and g.dtype == w.dtype, name
            np.testing.assert_array_equal(g, w, err_msg=name)
    lin = QuantLinear(rows, interleaved=True)  # and the layer built from them computes with them
    x = np.random.default_rng(0).standard_normal((3, k)).astype(np.float32)
    np.testing.assert_array_equal(lin(x), QuantLinear([ql.decode(a[perm], qtype), ql.decode(b, qtype)], interleaved=True)(x))
