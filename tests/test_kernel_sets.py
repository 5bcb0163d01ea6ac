"""freshness.kernel_sets: the kernel sets, the walkthrough tables' numbers and the bands drawn from them."""
from __future__ import annotations

import pytest

from freshness import kernel_sets as K

T1 = """Next-token NLL ...

| policy | trained at | B=32 | B=48 |
|---|---|---|---|
| dense (NLL) | - | 3.3455 | 3.3455 |
| dms | keep 0.125 | +0.1618 / 0.964 | -0.0259 / 0.972 |

| budget | last position | positions 0-25% |
|---|---|---|
| B=32 | 31.8 [21, 44] | 17.8 [17, 19] |
"""
T2 = (T1.replace("+0.1618 / 0.964", "+0.2281 / 0.958").replace("31.8 [21, 44]", "31.9 [22, 41]"))


def test_table_numbers_reads_both_tables_by_row():
    n = K.table_numbers(T1)
    assert n == {"dense (NLL)": [3.3455, 3.3455], "dms": [0.1618, 0.964, -0.0259, 0.972],
                 "entries B=32": [31.8, 21, 44, 17.8, 17, 19]}


def test_bands_are_the_margin_times_the_largest_move_rounded_up():
    b = K.walkthrough_bands({"avx512": T1, "avx2": T2})
    assert b == {"dense (NLL)": 0.0, "dms": pytest.approx(0.10), "entries B=32": 5.0}  # 1.5 x 0.0663; 1.5 x 3
    with pytest.raises(ValueError, match="another shape"):
        K.walkthrough_bands({"avx512": T1, "avx2": T1.replace("| 3.3455 |\n", "|\n", 1)})


def test_every_kernel_set_names_its_variables_and_an_unknown_one_is_refused(monkeypatch):
    monkeypatch.setenv("MKL_CBWR", "AVX512")
    env = K.env_of("avx2")
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and "MKL_CBWR" not in env and env["OMP_NUM_THREADS"] == "1"
    assert K.env_of("avx2+mkl-compatible")["MKL_CBWR"] == "COMPATIBLE"
    with pytest.raises(ValueError, match="unknown kernel set 'avx1'.*avx512, avx2"):
        K.env_of("avx1")
    ks = K.kernel_set()
    assert ks["aten_cpu_capability"] in ("DEFAULT", "AVX2", "AVX512", "ZVECTOR", "VSX", "SVE256", "NO AVX")
    assert ks["torch"]


def test_a_stamp_records_the_kernel_set_the_file_was_made_with(monkeypatch):
    import freshness as F

    spec = "README.md#walkthrough"
    g = F.group_of(spec)
    today = F.Sentinels(digests={s: "d" for s in g.sentinels})
    monkeypatch.setattr(F, "machine_digest", lambda: "m")
    monkeypatch.setattr(K, "kernel_set", lambda: {"aten_cpu_capability": "AVX2", "mkl_cbwr": "COMPATIBLE",
                                                  "cpu": "x", "torch": "t"})
    man = F.stamp([spec], today, man={"machine": "m", "files": {}})
    assert man["files"][spec]["kernel_set"]["aten_cpu_capability"] == "AVX2"
    assert man["kernel_set"]["mkl_cbwr"] == "COMPATIBLE"
