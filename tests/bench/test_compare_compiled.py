"""``python -m bench.compare_compiled`` (issue 53): bad flags are one-line errors, and its readers of the compiled
output find loops, loads and hints where they are. The compile itself (a minute on two cores) runs by hand, not here.
"""
import os
import subprocess
import sys

import pytest

from bench import compare_compiled as cc

pytestmark = pytest.mark.slow  # the benchmark tools

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SASS = """
//--------------------- .text.k --------------------------
        .section        .text.k,"ax",@progbits
k:
.text.k:
        /*0000*/                   S2R R0, SR_TID.X ;
.L_x_0:
        /*0010*/              @!P0 LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/                   SHFL.BFLY PT, R5, R4, 0x10, 0x1f ;
        /*0030*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0040*/                   FADD R6, R5, R4 ;
        /*0050*/              @!P1 BRA `(.L_x_0) ;
        /*0060*/                   STG.E desc[UR4][R8.64], R6 ;
        /*0070*/                   EXIT ;
.L_x_1:
        /*0080*/                   BRA `(.L_x_1);
        .type           $__internal_0_$__cuda_sm20_div_s64,@function
$__internal_0_$__cuda_sm20_div_s64:
        /*0090*/                   LDG.E.64 R2, desc[UR4][R2.64] ;
"""

PTX = """
.visible .entry k(
)
{
\tmov.u32 \t%r1, 0;
$L__BB0_1:
\t@%p1 ld.global.L1::evict_last.v4.b32 { %r2, %r3, %r4, %r5 }, [ %rd1 + 0 ];
\tadd.s32 \t%r1, %r1, 1;
\t@%p2 bra \t$L__BB0_1;
\tld.global.b64 \t%rd2, [ %rd3 + 0 ];
\tst.global.b32 \t[ %rd4 + 0 ], %r1;
\tret;
}
"""


@pytest.mark.parametrize("args", [("--n", "3"), ("--arch", "70"), ("--only", "nothing"), ("--bogus",)])
def test_bad_flags_are_one_line(args):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-m", "bench.compare_compiled", *args], capture_output=True, text=True,
                       cwd=ROOT, timeout=120, env=env)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "python -m bench.compare_compiled --help" in r.stderr


def test_sass_loop_and_what_follows_it():
    s = cc.analyse_sass(SASS)
    assert s["total"] == 9  # the kernel's own code: not the int64 division helper after it
    (loop,) = s["loops"]  # the trap's branch to itself after EXIT is no loop
    assert loop["kind"] == "load+reduce" and loop["instructions"] == 5 and loop["load_bytes"] == 16
    assert loop["ldg"] == {"LDG.E.128": 1} and loop["classes"]["BAR"] == 1 and loop["classes"]["SHFL"] == 1
    assert s["after_hot"]["ops"] == {"STG.E": 1} and s["after_hot"]["loops_after"] == 0


def test_ptx_loads_in_and_out_of_loops_with_hints():
    p = cc.analyse_ptx(PTX)
    assert p["loads_in_loops"] == {"ld.global.L1::evict_last.v4.b32": 1}
    assert p["loads_outside"] == {"ld.global.b64": 1} and p["stores_outside"] == {"st.global.b32": 1}
    assert p["hints"] == ["L1::evict_last"] and p["bar_sync"] == 0


def test_occupancy_rules():
    # sm_90: 37 registers x 8 warps -> registers allow 6 CTAs; 90 x 1 warp -> 20 (register file split in 4); 16-warp
    # CTAs -> 4 by threads; shared memory binds when large
    assert cc.occupancy(90, 37, 8, 1056) == 6
    assert cc.occupancy(90, 90, 1, 0) == 20
    assert cc.occupancy(90, 32, 16, 0) == 4
    assert cc.occupancy(80, 32, 1, 100 * 1024) == 1
