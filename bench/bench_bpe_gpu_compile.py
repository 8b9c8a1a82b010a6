"""Registers, spills (STL/LDL), bar.sync, PTX and SASS instruction counts of train_bpe_gpu.py's kernels, compiled
without a GPU (Triton's bundled ptxas and cuobjdump), at CUDA's shape, as tests/test_train_bpe_gpu.py compiles them:
the static side of the merge loop's cost model (bench/RESULTS.md).

    python bench/bench_bpe_gpu_compile.py . 90 80          # REPO_DIR (whose train_bpe_gpu.py), then the archs
    STATE=i64 python bench/bench_bpe_gpu_compile.py OLD_CHECKOUT 90 80   # before `state` became int32 (5934ac8)
"""
import os, re, subprocess, sys, tempfile
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, sys.argv[1])
import triton
import train_bpe_gpu as bpe
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
INT64 = {"batch", "row_keys", "block_key", "fresh_keys", "list_start", "list_len", "merge_log"}
INT64 |= {"state"} if os.environ.get("STATE") == "i64" else set()  # STATE=i64: before 'state' went int32
SHAPE = dict(BLOCK=256, ROWS=4, KEY_BLOCK=256, POSITIONS=256, SLOTS=8)
KERNELS = (bpe.choose_batch, bpe.find_occurrences, bpe.apply_merges, bpe.refresh_rows)
archs = [int(a) for a in sys.argv[2:]] or [90, 80]
print(f"{'arch':5} {'kernel':17} {'counts':6} {'regs':>4} {'STL/LDL':>11} {'bar.sync':>8} {'PTX ins':>7} "
      f"{'SASS ins':>8} {'PTX s64/u64 ops':>15}  SASS loops")
for arch in archs:
    for counts in ("*i32", "*i64"):
        for kernel in KERNELS:
            names = kernel.arg_names
            if counts == "*i64" and "counts" not in names:
                continue
            signature = {name: "constexpr" if name in SHAPE else "i32" if name in ("V", "END", "max_batch") else
                         counts if name in ("counts", "weight") else "*i64" if name in INT64 else "*i32"
                         for name in names}
            constexprs = {(names.index(name),): value for name, value in SHAPE.items() if name in names}
            asm = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", arch, 32)).asm
            ptx = asm["ptx"]
            body = ptx[ptx.index(".entry"):]
            instructions = [line.strip() for line in body.splitlines()
                            if line.strip().endswith(";") and not line.strip().startswith((".", "//", "{", "}"))]
            wide = sum(1 for line in instructions if re.match(r"^(@!?%p\d+\s+)?[a-z.]+\.(s64|u64|b64)\b", line)
                       and not line.startswith(("ld.param", "cvt", "mov")))
            with tempfile.TemporaryDirectory() as tmp:
                open(os.path.join(tmp, "k.cubin"), "wb").write(asm["cubin"])  # Triton's own: registers, SASS
                usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", os.path.join(tmp, "k.cubin")],
                                       capture_output=True, text=True).stdout
                sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", os.path.join(tmp, "k.cubin")],
                                      capture_output=True, text=True).stdout
            regs = re.search(r"REG:(\d+)", usage).group(1)
            # spills: local-memory stores and loads in Triton's own SASS (a separate ptxas run may differ)
            spills = (str(len(re.findall(r"\bSTL\b", sass))), str(len(re.findall(r"\bLDL\b", sass))))
            sass_count = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s*(?!NOP\b)\S", sass, re.M))  # NOPs: padding
            # each loop: the SASS instructions from a backward branch's target to the branch
            lines = re.findall(r"^\s+/\*([0-9a-f]{4})\*/\s*(.*?);", sass, re.M)
            lines = [(int(address, 16), text) for address, text in lines if not text.startswith("NOP")]
            loops = []
            for address, text in lines:
                target = re.search(r"\bBRA\s+0x([0-9a-f]+)", text)
                if target and int(target.group(1), 16) < address:  # (a BRA to itself ends the code)
                    loops.append(sum(1 for a, _ in lines if int(target.group(1), 16) <= a <= address))
            bars = len(re.findall(r"\bbar\.sync\b|\bbarrier\.sync\b", ptx))
            print(f"sm_{arch} {kernel.fn.__name__:17} {counts[1:]:6} {regs:>4} {'/'.join(spills):>11} {bars:>8} "
                  f"{len(instructions):>7} {sass_count:>8} {wide:>15}  {loops}")
