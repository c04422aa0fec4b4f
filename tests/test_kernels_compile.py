"""Every @triton.jit kernel of tahnode compiles for sm_90 (H100) without a GPU: Triton's own
front end, TTIR -> TTGIR -> LLVM IR -> PTX, and ptxas (bundled in the triton wheel) -> cubin.

The interpreter (TRITON_INTERPRET=1, set for the rest of the suite) replaces triton.jit with a
Python executor, so the compilation runs in a subprocess with TRITON_INTERPRET removed; run this
file directly (python tests/test_kernels_compile.py) to compile without pytest, with --resources to
print every kernel's registers, spills and instructions as launched on aligned tensors (docs/
benchmarks-log.md, "Kernel resources on sm_90"), with --settings beside it for the default pair at the
sweep's launch settings, with --shard i/n to compile every n-th case from case i (the test runs a
shard per core)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

PTR = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}


def _symtiles_signatures(dt: str) -> tuple[dict, dict]:
    """The runtime arguments of symtiles_triton's encode and decode kernels for input dtype dt."""
    return (dict(x_ptr=PTR[dt], stride_x="i32", signs_ptr="*fp32", n_rows="i32", n_chan="i32", n_tpt="i32", width="i32",
                 scale_ptr="*bf16", out_ptr="*u8", n_pad="i64", codes_ptr="*u8", status_ptr="*i32", sums_ptr="*i32"),
            dict(codes_ptr="*u8", n_pad="i64", scale_ptr="*bf16", signs_ptr="*fp32", out_ptr=PTR[dt], bad_ptr="*u8",
                 n_rows="i32", n_chan="i32", n_tpt="i32", width="i32"))


# the runtime arguments of rice_triton's write and values kernels
RICE_WRITE = dict(codes_ptr="*u8", n="i32", sums_ptr="*i32", ends_ptr="*i64", payload_ptr="*u8", start="i64")
RICE_VALUES = dict(unary_ptr="*u8", nbytes="i64", rank_ptr="*i64", low_ptr="*u8", n="i64", codes_ptr="*u8",
                   bad_ptr="*u8")


def _case(name: str, kernel, sig: dict, const: dict) -> tuple:
    """(name, kernel, signature with the constexprs named in it, constexprs): a case of _cases."""
    return name, kernel, dict(sig, **{k: "constexpr" for k in const}), const


def _cases():
    """(name, kernel, signature, constexprs) for every kernel at representative configurations."""
    import triton

    from tahnode.kernels import tahquant_triton as tq
    from tahnode.kernels.tahquant_ref import Layout, PaperParams

    out = []
    for dt, c, g in (("bf16", 4096, 64), ("fp32", 64, 64), ("fp16", 1600, 128), ("bf16", 40, 64), ("fp32", 8, 8)):
        rows, block = tq._stats_blocks(c, g)
        sig = dict(x_ptr=PTR[dt], stride_x="i32", ent_ptr="*fp32", flag_ptr="*u8", piv_ptr="*u8", status_ptr="*i32",
                   n_tokens="i32", n_chan="i32", n_tpt="i32", tau="fp32",
                   G="constexpr", ROWS="constexpr", BLOCK="constexpr", NCHUNK="constexpr")
        const = dict(G=g, ROWS=rows, BLOCK=block, NCHUNK=triton.cdiv(c, block))
        out.append((f"stats {dt} C={c} G={g}", tq._stats_kernel, sig, const))

    for sb in (64, 2048, 8192):
        sig = dict(ent_ptr="*fp32", seq_len="i32", n_low="i32", slack2="fp64", n_slots="i32", thr_ptr="*fp64",
                   cnt_ptr="*i32", cand_i_ptr="*i32", status_ptr="*i32", SB="constexpr", NSLOT="constexpr")
        out.append((f"cut SB={sb}", tq._cut_kernel, sig, dict(SB=sb, NSLOT=tq.NSLOT)))
        sig = dict(ent_ptr="*fp32", thr_ptr="*fp64", cnt_ptr="*i32", cand_e_ptr="*fp64", cand_i_ptr="*i32",
                   low_ptr="*u8", off_ptr="*i64", seq_len="i32", n_low="i32", n_slots="i32", seq_bytes="i64",
                   tok_bytes="i32", diff_bytes="i32", SB="constexpr", NSLOT="constexpr")
        out.append((f"alloc SB={sb}", tq._alloc_kernel, sig, dict(SB=sb, NSLOT=tq.NSLOT)))
    for dt in ("bf16", "fp32"):
        sig = dict(x_ptr=PTR[dt], stride_x="i32", seq_len="i32", n_chan="i32", cnt_ptr="*i32", cand_e_ptr="*fp64",
                   cand_i_ptr="*i32", NSLOT="constexpr", CB="constexpr", NCB="constexpr")
        out.append((f"refine {dt}", tq._refine_kernel, sig, dict(NSLOT=tq.NSLOT, CB=1024, NCB=4)))

    configs = [
        ("bf16", PaperParams()),
        ("fp16", PaperParams(bits_high=5, bits_low=4)),  # planes 4+1 and 4
        ("fp32", PaperParams(group_size=8, bits_high=8, bits_low=5)),
        ("bf16", PaperParams(group_size=16, bits_high=2, bits_low=2)),
        ("bf16", PaperParams(group_size=32)),
        ("bf16", PaperParams(group_size=128)),
        ("fp32", PaperParams(group_size=256, bits_high=7, bits_low=6)),
    ]
    for dt, p in configs:
        cx, _, _ = tq._launch_config(p, Layout.of((2, 64, 4096), p.group_size), tq.GPU_ENCODE_BLOCK)
        assert cx["TC"] == 1, "compile the GPU launch configuration"
        const = dict(cx, num_warps=tq.GPU_ENCODE_BLOCK[1])
        sig = dict(x_ptr=PTR[dt], stride_x="i32", n_tokens="i32", n_chan="i32", n_tpt="i32", flag_ptr="*u8",
                   piv_ptr="*u8", cum_ptr="*i32", low_ptr="*u8", off_ptr="*i64", codes_ptr="*u8", n_codes="i64",
                   zero_ptr="*fp16", scale_ptr="*fp16", compact_ptr="*u8", status_ptr="*i32")
        sig.update({k: "constexpr" for k in const})
        out.append((f"tahquant encode {dt} {p}", tq._encode_kernel, sig, const))
        planes = tq._pivot_planes(p)
        sig = dict(out_ptr="*u8", low_ptr="*u8", flag_ptr="*u8", zs_ptr="*u8", compact_ptr="*u8", cum_ptr="*i32",
                   status_ptr="*i32", n_alloc="i32", nt="i32", bm_a="i32", bm_f="i32", head="i32", piv_max="i32")
        aconst = dict(planes, BLK=tq._byte_block())
        sig.update({k: "constexpr" for k in aconst})
        out.append((f"tahquant assemble {p}", tq._assemble_kernel, sig, aconst))
        sig = dict(pay_ptr="*u8", n_pay="i64", cum_ptr="*i32", status_ptr="*i32", out_ptr=PTR[dt], stride_out="i32",
                   n_tokens="i32", n_chan="i32", n_tpt="i32", nt="i32", bm_a="i32", bm_f="i32", head="i32")
        dcx, _, _ = tq._launch_config(p, Layout.of((2, 64, 4096), p.group_size), tq.GPU_DECODE_BLOCK)
        dconst = dict(dcx, OUT_BF16=dt == "bf16", num_warps=tq.GPU_DECODE_BLOCK[1], **planes)
        sig.update({k: "constexpr" for k in dconst})
        out.append((f"tahquant decode {dt} {p}", tq._decode_kernel, sig, dconst))
    sig = dict(pay_ptr="*u8", pc_ptr="*i32", status_ptr="*i32", n_bytes="i32", bm_a="i32", n_alloc="i32", nt="i32",
               BLK="constexpr")
    out.append(("tahquant bitcount", tq._bitcount_kernel, sig, dict(BLK=tq._byte_block())))

    from tahnode.kernels import symtiles_triton as st
    for dt, g, bits, rotate, packed in (("bf16", 128, 6, False, True), ("fp32", 32, 6, False, False),
                                        ("bf16", 64, 4, True, True), ("fp16", 32, 4, True, True),
                                        ("fp32", 256, 8, True, True), ("bf16", 8, 3, False, True)):
        const = dict(G=g, QMAX=2 ** (bits - 1) - 1, ROTATE=rotate, BR=4096 // g, **st.plane_shifts(bits))
        esig, dsig = _symtiles_signatures(dt)
        sums = dict(SUMS_BLOCK=1024 if rotate else 0, KMAX=(2 * const["QMAX"]).bit_length())  # tahquant sums for Rice
        out.append(_case(f"symtiles encode {dt} G={g} bits={bits} rotate={rotate} packed={packed}", st._encode_kernel,
                         esig, dict(const, PACKED=packed, **sums)))
        out.append(_case(f"symtiles decode {dt} G={g} bits={bits} rotate={rotate}", st._decode_kernel, dsig,
                         dict(const, OUT_BF16=dt == "bf16", SHORT=not rotate)))
    for bits in (6, 3):
        const = dict(BLOCK=4096, **st.plane_shifts(bits))
        sig = dict(codes_ptr="*u8", out_ptr="*u8", n="i64", n_pad="i64", **{k: "constexpr" for k in const})
        out.append((f"symtiles pack bits={bits}", st._pack_kernel, sig, const))

    from tahnode.kernels import rice_triton as rt
    for qmax in (12, 127):
        const = dict(QMAX=qmax, KMAX=(2 * qmax).bit_length(), BLOCK=1024)
        sig = dict(codes_ptr="*u8", n="i64", sums_ptr="*i32", **{k: "constexpr" for k in const})
        out.append((f"rice sums qmax={qmax}", rt._sums_kernel, sig, const))
    for qmax, k in ((12, 0), (12, 3), (31, 5), (127, 8)):
        out.append(_case(f"rice write qmax={qmax} k={k}", rt._write_kernel, RICE_WRITE,
                         dict(QMAX=qmax, K=k, BLOCK=1024, PER_LANE=rt._values_per_lane(1024, 4), **st.plane_shifts(k))))
    for kmax in (5, 8):
        const = dict(KMAX=kmax, num_warps=1)
        sig = dict(totals_ptr="*i64", n="i32", start="i64", capacity="i64", picked_ptr="*i64", payload_ptr="*u8",
                   KMAX="constexpr")
        out.append((f"rice pick kmax={kmax}", rt._pick_kernel, sig, const))
    for qmax, k in ((12, 0), (12, 3), (31, 5), (127, 8)):
        out.append(_case(f"rice values qmax={qmax} k={k}", rt._values_kernel, RICE_VALUES,
                         dict(QMAX=qmax, K=k, WINDOWS=-(-((2 * qmax >> k) + 1) // 32), BLOCK=256,
                              PER_LANE=rt._bytes_per_lane(256, 4), **st.plane_shifts(k))))
    sig = dict(unary_ptr="*u8", nbytes="i64", count_ptr="*i32", BLOCK="constexpr")
    out.append(("rice zeros", rt._zeros_kernel, sig, dict(BLOCK=256)))
    return out


def _setting_cases():
    """The default pair's kernels (pertoken's and tahquant's: bf16, G = 128, qmax 31 and 12, Rice at
    k = 2) at each launch setting `tahnode bench kernels --sweep` times (node/tools/bench_sweep.py),
    the modules' defaults first: (name, kernel, signature, constexprs) as _cases."""
    from tahnode.kernels import rice_triton as rt
    from tahnode.kernels import symtiles_triton as st
    from tahnode.tools.bench_sweep import RICE_BLOCKS, SYMTILES_BLOCKS

    out = []
    esig, dsig = _symtiles_signatures("bf16")
    for values, warps in [st.GPU_ENCODE_BLOCK] + SYMTILES_BLOCKS:
        for what, bits, qmax, rotate in (("pertoken", 6, 31, False), ("tahquant", 8, 12, True)):
            const = dict(G=128, QMAX=qmax, ROTATE=rotate, BR=values // 128, num_warps=warps, **st.plane_shifts(bits))
            sums = dict(SUMS_BLOCK=rt.GPU_ENCODE_BLOCK[0] if rotate else 0, KMAX=(2 * qmax).bit_length())
            out.append(_case(f"{what} encode [{values}/{warps}]", st._encode_kernel, esig,
                             dict(const, PACKED=True, **sums)))
            out.append(_case(f"{what} decode [{values}/{warps}]", st._decode_kernel, dsig,
                             dict(const, OUT_BF16=True, SHORT=False)))
    for (values, warps), (nbytes, dwarps) in [(rt.GPU_ENCODE_BLOCK, rt.GPU_DECODE_BLOCK)] + RICE_BLOCKS:
        out.append(_case(f"rice write [{values}/{warps}]", rt._write_kernel, RICE_WRITE,
                         dict(QMAX=12, K=2, BLOCK=values, PER_LANE=rt._values_per_lane(values, warps), num_warps=warps,
                              **st.plane_shifts(2))))
        out.append(_case(f"rice values [{nbytes}/{dwarps}]", rt._values_kernel, RICE_VALUES,
                         dict(QMAX=12, K=2, WINDOWS=1, BLOCK=nbytes, PER_LANE=rt._bytes_per_lane(nbytes, dwarps),
                              num_warps=dwarps, **st.plane_shifts(2))))
    return out


def _aligned(kernel, sig: dict) -> dict:
    """The attributes the JIT gives a launch whose pointers are 16-byte aligned and whose integer
    arguments are multiples of 16 (every tensor and size of the bench's shapes): without them ptxas
    sees unvectorized code (pertoken's decode: 242 registers and 2232 instructions, against 64 and
    1216 as launched there)."""
    return {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a, v in sig.items() if v != "constexpr"}


def instructions(cubin: bytes) -> int:
    """The SASS instructions in a cubin (cuobjdump -sass): a straight-line kernel's thread runs about
    that many."""
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return sum(1 for line in out.splitlines() if line.strip().startswith("/*") and "*/" in line and ";" in line)


def resource_usage(cubin: bytes) -> str:
    """Registers, stack and local bytes per thread of a cubin's kernel, as cuobjdump (in Triton's
    wheel) reads them: a stack or local memory means spilled registers."""
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    fields = dict(part.split(":") for line in out.splitlines() if "REG:" in line for part in line.split())
    return f"{fields['REG']:>3} registers, stack {fields['STACK']} B, local {fields['LOCAL']} B"


def compile_all(verbose: bool = True, resources: bool = False, shard: int = 0, shards: int = 1,
                settings: bool = False) -> tuple[int, int]:
    """Compile every `shards`-th case for sm_90, from case `shard` on; returns (compiled, cases in
    all) and raises on the first failure. resources: print each kernel's registers, spills and
    instructions, compiled as launched on aligned tensors (_aligned). settings: the default pair at
    the sweep's launch settings (_setting_cases) instead of every kernel."""
    import triton
    from triton.backends.compiler import GPUTarget

    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "unset TRITON_INTERPRET to compile"
    target = GPUTarget("cuda", 90, 32)
    n, cases = 0, _setting_cases() if settings else _cases()
    for name, kernel, sig, const in cases[shard::shards]:
        t0 = time.time()
        warps = const.pop("num_warps", 4)  # a launch option, not a constexpr
        sig = {k: v for k, v in sig.items() if k != "num_warps"}
        src = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=const,
                                        attrs=_aligned(kernel, sig) if resources else None)
        compiled = triton.compile(src, target=target, options=dict(num_warps=warps))
        asm = compiled.asm
        assert "ptx" in asm and ".target sm_90" in asm["ptx"], name
        assert len(asm.get("cubin", b"")) > 0, f"{name}: no cubin"
        n += 1
        if resources:
            print(f"{resource_usage(asm['cubin'])}, {instructions(asm['cubin']):>5} instructions  "
                  f"{name} ({warps} warps)", flush=True)
        elif verbose:
            print(f"ok {time.time() - t0:5.1f}s  {name}", flush=True)
    return n, len(cases)


def test_every_kernel_compiles_for_sm90(tmp_path):
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # really compile, not a cache hit
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when unset; 1 is 3.6's behaviour
    shards = max(1, min(4, os.cpu_count() or 1))  # a compiler process per core: they share nothing
    procs = [subprocess.Popen([sys.executable, __file__, "--shard", f"{i}/{shards}"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(shards)]
    compiled, total = 0, set()
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=540)
            assert proc.returncode == 0, out[-3000:] + err[-6000:]
            done = [line.split() for line in out.splitlines() if line.startswith("compiled ")]
            assert done, out
            compiled += int(done[-1][1])
            total.add(int(done[-1][3]))
    finally:
        for proc in procs:
            proc.kill()
    assert len(total) == 1 and compiled == total.pop() > 60  # every case, once


if __name__ == "__main__":
    at = sys.argv.index("--shard") + 1 if "--shard" in sys.argv else 0
    shard, shards = map(int, sys.argv[at].split("/")) if at else (0, 1)
    n, cases = compile_all(resources="--resources" in sys.argv, shard=shard, shards=shards,
                           settings="--settings" in sys.argv)
    print(f"compiled {n} of {cases} kernels for sm_90")
