#!/usr/bin/env python3
"""The SASS gate (scripts/sass_gate.sh): checks the machine code of every CUDA kernel of a build.

Disassembles each CUDA object (those listed in a build directory's cuda_objects.txt, written by
CMakeLists.txt; else every *.cu.o under the given directories) with cuobjdump -sass,
reads ptxas's report kept beside it (OBJECT.ptxas.log, written by scripts/ptxas_log.sh), and
checks per kernel:
  every kernel       SASS for sm_90 (or sm_90a), the Hopper target of the build;
  every kernel       no local-memory access in its SASS (LDL/STL: spills or a local array) and no
                     spill stores or loads in ptxas's report;
  memory-bound       at least one 16-byte global load (LDG.E.128), so the kernel moves its data
                     in vectors (narrower loads, e.g. a scalar tail, are counted and listed);
  tensor-core-gemm   at least one HGMMA (the sm_90a warpgroup MMA).
The marks come from a rules file: one rule a line, `PATTERN MARK...`, PATTERN an fnmatch glob
on the kernel's demangled name without its parameter list (e.g. `*::rmsnorm_forward<*>`). A rule
that matches no kernel is an error (a stale rule checks nothing). Prints every kernel checked
and exits 1 if any rule fails. Zero kernels pass (nothing to check), and say so.
"""
import argparse
import fnmatch
import os
import re
import shutil
import subprocess
import sys

MARKS = {"memory-bound", "tensor-core-gemm"}


def parse_rules(path):
    rules = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            pattern, *marks = line.split()
            bad = [m for m in marks if m not in MARKS]
            if not marks or bad:
                sys.exit(f"[sass-gate] {path}:{n}: a rule is `PATTERN MARK...` with MARK one of "
                         f"{sorted(MARKS)}; got {line!r}")
            rules.append((pattern, set(marks), f"{os.path.basename(path)}:{n}"))
    return rules


def find_objects(paths):
    objects = []
    for p in paths:
        if os.path.isfile(p):
            objects.append(p)
            continue
        if not os.path.isdir(p):
            sys.exit(f"[sass-gate] {p}: no such file or directory (give the CUDA build's directory, "
                     f"e.g. build-cuda, or object files)")
        listed = os.path.join(p, "cuda_objects.txt")  # the build's own list (CMakeLists.txt)
        if os.path.isfile(listed):
            with open(listed) as f:
                objects += [os.path.join(p, o) for o in f.read().split() if o]
            continue
        for root, _, files in os.walk(p):
            objects += [os.path.join(root, f) for f in files if f.endswith(".cu.o")]
    return sorted(objects)


INSTR = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_.]*)")


def disassemble(cuobjdump, obj):
    """{(mangled name, arch): opcode list} of the object's kernels, or {} without device code."""
    r = subprocess.run([cuobjdump, "-sass", obj], capture_output=True, text=True)
    if r.returncode != 0:
        if "does not contain device code" in r.stdout + r.stderr:
            return {}
        sys.exit(f"[sass-gate] cuobjdump -sass {obj} failed ({r.returncode}): {r.stderr.strip()}")
    kernels, arch, current = {}, "?", None
    for line in r.stdout.splitlines():
        m = re.match(r"^\s*arch = (sm_\w+)", line)
        if m:
            arch = m.group(1)
            continue
        m = re.match(r"^\s*Function : (\S+)", line)
        if m:
            current = kernels.setdefault((m.group(1), arch), [])
            continue
        m = INSTR.match(line)
        if m and current is not None:
            current.append(m.group(1))
    return kernels


def ptxas_report(log):
    """{(mangled name, arch): {regs, stack, spill_stores, spill_loads}} from ptxas -v output."""
    out, name, arch = {}, None, "?"
    with open(log, errors="replace") as f:
        for line in f:
            m = re.search(r"Compiling entry function '([^']+)' for '(sm_\w+)'", line)
            if m:
                arch = m.group(2)
            m = re.search(r"Function properties for (\S+)", line)
            if m:
                name = m.group(1)
                out.setdefault((name, arch), {"regs": None})
                continue
            m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                          line)
            if m and name:
                out[(name, arch)].update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                                         spill_loads=int(m.group(3)))
                continue
            m = re.search(r"Used (\d+) registers", line)
            if m and name:
                out[(name, arch)]["regs"] = int(m.group(1))
    return out


def demangle(names):
    if not names:
        return {}
    cxxfilt = shutil.which("c++filt")
    if not cxxfilt:
        return {n: n for n in names}
    r = subprocess.run([cxxfilt], input="\n".join(names) + "\n", capture_output=True, text=True)
    return dict(zip(names, r.stdout.splitlines()))


def base_name(demangled):
    """The demangled name without its parameter list: the text before the last top-level '('."""
    depth = 0
    for i in range(len(demangled) - 1, -1, -1):
        c = demangled[i]
        if c == ")":
            depth += 1
        elif c == "(":
            depth -= 1
            if depth == 0:
                return demangled[:i]
    return demangled


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cuobjdump", required=True)
    ap.add_argument("--rules", required=True)
    ap.add_argument("paths", nargs="+", help="the CUDA build's directory, or object files")
    args = ap.parse_args()

    rules = parse_rules(args.rules)
    objects = find_objects(args.paths)
    rows, failures, used = [], [], set()
    n_objects = 0
    for obj in objects:
        if not os.path.isfile(obj):
            failures.append(f"{obj}: listed by the build but not built: build the CUDA configuration first")
            continue
        kernels = disassemble(args.cuobjdump, obj)
        log = obj + ".ptxas.log"
        report = {}
        if os.path.exists(log):
            report = ptxas_report(log)
        elif kernels:
            failures.append(f"{obj}: no ptxas report beside it ({os.path.basename(log)}): build it "
                            f"through scripts/ptxas_log.sh with -Xptxas=-v (CMakeLists.txt does)")
        if not kernels and not report:
            continue
        n_objects += 1
        # Spills in non-kernel device functions appear in ptxas's report only.
        for (name, arch), r in report.items():
            if r.get("spill_stores") or r.get("spill_loads"):
                if (name, arch) not in kernels:
                    failures.append(f"{name} ({arch}, {obj}): ptxas spills {r['spill_stores']} bytes "
                                    f"stored / {r['spill_loads']} loaded to local memory")
        names = demangle(sorted({n for n, _ in kernels}))
        for (name, arch), ops in sorted(kernels.items()):
            pretty = base_name(names.get(name, name))
            marks = set()
            for pattern, m, where in rules:
                if fnmatch.fnmatchcase(pretty, pattern):
                    marks |= m
                    used.add(where)
            r = report.get((name, arch), {})
            local = sum(1 for o in ops if o.startswith(("LDL", "STL")))
            ldg = [o for o in ops if o.startswith("LDG")]
            ldg128 = sum(1 for o in ldg if ".128" in o)
            hgmma = sum(1 for o in ops if o.startswith("HGMMA"))
            why = []
            if arch not in ("sm_90", "sm_90a"):
                why.append(f"its SASS is for {arch}, not sm_90 (MOECORE_CUDA_ARCHITECTURES)")
            if local:
                why.append(f"{local} local-memory instructions (LDL/STL) in its SASS")
            if r.get("spill_stores") or r.get("spill_loads"):
                why.append(f"ptxas spills {r['spill_stores']} bytes stored / {r['spill_loads']} loaded")
            if "memory-bound" in marks and ldg128 == 0:
                why.append(f"marked memory-bound but none of its {len(ldg)} global loads is 16 bytes "
                           f"(LDG.E.128): load float4/uint4 vectors")
            if "tensor-core-gemm" in marks and hgmma == 0:
                why.append("marked tensor-core-gemm but has no HGMMA (compile it for sm_90a: "
                           "name the file *_sm90a.cu)")
            for w in why:
                failures.append(f"{pretty} ({arch}, {obj}): {w}")
            rows.append((pretty, arch, r.get("regs"), r.get("stack"),
                         f"{r.get('spill_stores', '?')}/{r.get('spill_loads', '?')}", local,
                         f"{ldg128}/{len(ldg) - ldg128}", hgmma, ",".join(sorted(marks)) or "-",
                         "FAIL" if why else "ok"))
    for pattern, _, where in rules:
        if where not in used:
            failures.append(f"rule {where} `{pattern}` matches no kernel: fix or remove it")

    print(f"[sass-gate] {len(rows)} kernels in {n_objects} objects with device code "
          f"({len(objects)} CUDA objects searched), rules {args.rules}")
    if rows:
        head = ("kernel", "arch", "regs", "stack", "spill st/ld", "LDL/STL", "LDG 128/narrow",
                "HGMMA", "marks", "result")
        width = max(len(head[0]), *(len(r[0]) for r in rows))
        fmt = f"  {{:<{width}}}  {{:<6}} {{:>4}} {{:>5}} {{:>11}} {{:>7}} {{:>14}} {{:>5}}  {{:<24}} {{}}"
        print(fmt.format(*head))
        for r in rows:
            print(fmt.format(*("-" if v is None else str(v) for v in r)))
    for f in failures:
        print(f"[sass-gate] FAIL: {f}")
    print(f"[sass-gate] {'FAILED' if failures else 'passed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
