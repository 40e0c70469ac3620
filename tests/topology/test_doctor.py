"""`uccl-ep-train doctor`: checks against recorded hosts, this machine, the JSON schema and exit codes."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from uccl_ep_train import cli, doctor

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "sysfs")
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _run(host, env=None):
    d = doctor.Doctor(os.path.join(FIXTURES, host), env=env or {}, use_tools=False)
    checks = {c.name: c for c in d.run()}
    return d, checks


def test_doctor_on_this_machine_reports_missing_gpu_and_nic_and_exits_0():
    has_gpu = os.path.exists("/dev/nvidia0") or os.path.exists("/dev/kfd")
    has_nic = os.path.isdir("/sys/class/infiniband") and bool(os.listdir("/sys/class/infiniband"))
    if has_gpu or has_nic:
        pytest.skip("this machine has a GPU or an RDMA NIC")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCCL_", "NCCL_"))}
    proc = subprocess.run([sys.executable, "-m", "uccl_ep_train.cli", "doctor"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == doctor.EXIT_OK, proc.stdout + proc.stderr
    assert "no GPU, no RDMA NIC: this host can run the host core and CPU tests only" in proc.stdout
    assert "[WARN] gpus: no GPU found" in proc.stdout and "[WARN] rdma_nics: no RDMA device" in proc.stdout
    assert "0 failed" in proc.stdout


def test_json_report_has_every_section_and_its_summary_and_exit_code_agree_with_the_checks(capsys):
    code = cli.main(["doctor", "--json", "--sysfs-root", os.path.join(FIXTURES, "cx7_roce")])
    report = json.loads(capsys.readouterr().out)
    assert set(report) >= {"version", "host", "sysfs_root", "host_summary", "summary", "checks", "topology",
                           "settings", "exit_code"}
    assert report["version"] == doctor.JSON_VERSION and report["exit_code"] == code
    assert all(set(c) == {"name", "status", "detail", "fix"} and c["status"] in ("pass", "warn", "fail")
               for c in report["checks"])
    assert report["summary"] == {s: sum(c["status"] == s for c in report["checks"]) for s in ("pass", "warn", "fail")}
    assert code == (doctor.EXIT_FAIL if report["summary"]["fail"] else doctor.EXIT_OK)
    plan = report["topology"]["plan"]
    assert [p["nics"] for p in plan] == [[f"mlx5_{i}"] for i in range(8)] and plan[0]["gid_index"] == [3]
    assert {n["name"] for n in report["topology"]["nics"]} == {f"mlx5_{i}" for i in range(9)}


def test_p5en_checks_efa_registration_gid_and_nccl_channels():
    _, checks = _run("p5en")
    assert checks["gpu_registration"].status == "pass" and "efa_nv_peermem" in checks["gpu_registration"].detail
    assert checks["gid"].status == "pass" and "EFA port: index 0" in checks["gid"].detail
    assert checks["nccl_efa_channels"].status == "warn" and "NCCL_MAX_NCHANNELS" in checks["nccl_efa_channels"].fix
    assert "rdmap39s0,rdmap40s0" in checks["gpu_nic_affinity"].detail
    _, checks = _run("p5en", {"NCCL_MAX_NCHANNELS": "8"})
    assert checks["nccl_efa_channels"].status == "pass"


def test_missing_peer_memory_module_fails_with_the_modprobe(tmp_path):
    import shutil
    root = tmp_path / "cx7"
    shutil.copytree(os.path.join(FIXTURES, "cx7_roce"), root, symlinks=True)
    shutil.rmtree(root / "module")
    d = doctor.Doctor(str(root), env={}, use_tools=False)
    checks = {c.name: c for c in d.run()}
    assert checks["gpu_registration"].status == "fail"
    assert "modprobe nvidia_peermem" in checks["gpu_registration"].fix
    assert doctor.exit_code(d.checks) == doctor.EXIT_FAIL


def _fork_check(host, kernel, env=None):
    d = doctor.Doctor(os.path.join(FIXTURES, host), env=env or {}, use_tools=False, kernel=kernel)
    return {c.name: c for c in d.run()}.get("fork_safety")


def test_fork_safety_warns_on_kernels_before_5_13_without_rdmav_fork_safe_and_gives_the_fix():
    c = _fork_check("cx7_roce", (5, 4))
    assert c.status == "warn" and "kernel 5.4 is older than 5.13" in c.detail and "ibv_fork_init()" in c.detail
    assert "DataLoader" in c.detail and "export RDMAV_FORK_SAFE=1" in c.fix
    assert _fork_check("p5en", (5, 10)).status == "warn"


@pytest.mark.parametrize("env", [{"RDMAV_FORK_SAFE": "1"}, {"IBV_FORK_SAFE": "1"}])
def test_fork_safety_passes_when_libibverbs_is_told_to_call_ibv_fork_init(env):
    c = _fork_check("cx7_roce", (5, 4), env)
    assert c.status == "pass" and f"{next(iter(env))}=1 is set" in c.detail


def test_fork_safety_passes_on_kernels_from_5_13_that_copy_pinned_pages_on_fork():
    for kernel in ((5, 13), (6, 8)):
        c = _fork_check("cx7_roce", kernel)
        assert c.status == "pass" and "not needed" in c.detail


def test_fork_safety_is_not_checked_without_rdma_nics_with_loopback_or_for_an_unknown_kernel():
    assert _fork_check("no_rdma", (5, 4)) is None
    assert _fork_check("cx7_roce", (5, 4), {"UCCL_EP_TRANSPORT": "loopback"}) is None
    assert _fork_check("cx7_roce", None) is None  # a recorded sysfs tree says nothing about the kernel


def test_thor2_gid_is_ipv6_and_a_bad_override_fails():
    _, checks = _run("mi300x_thor2")
    assert checks["gid"].status == "pass" and "global IPv6" in checks["gid"].detail
    _, checks = _run("mi300x_thor2", {"UCCL_IB_GID_INDEX": "9"})
    assert checks["gid"].status == "fail" and "UCCL_IB_GID_INDEX=9 names no GID" in checks["gid"].detail


def test_uccl_and_nccl_ib_settings_that_disagree_are_reported():
    _, checks = _run("cx7_roce", {"UCCL_IB_HCA": "mlx5_0", "NCCL_IB_HCA": "mlx5_1", "NCCL_IB_GID_INDEX": "3"})
    c = checks["nccl_consistency"]
    assert c.status == "warn" and "UCCL_IB_HCA=mlx5_0 but NCCL_IB_HCA=mlx5_1" in c.detail
    assert "NCCL_IB_GID_INDEX=3 is set but UCCL_IB_GID_INDEX is not" in c.detail


def test_malformed_setting_fails_the_settings_check():
    d, checks = _run("no_rdma", {"UCCL_IB_GID_INDEX": "abc"})
    assert checks["settings"].status == "fail" and "UCCL_IB_GID_INDEX" in checks["settings"].detail
    assert doctor.exit_code(d.checks) == doctor.EXIT_FAIL


def test_proxy_cpu_pinning_far_from_the_nics_is_flagged():
    _, checks = _run("cx7_roce", {"UCCL_EP_PROXY_CPUS": "0-3"})
    c = checks["proxy_cpus"]
    assert c.status == "warn" and "NUMA 1 needs 16 proxy cores, UCCL_EP_PROXY_CPUS gives 0" in c.detail


def test_strict_turns_warnings_into_failure():
    checks = [doctor.Check("a", "pass", ""), doctor.Check("b", "warn", "")]
    assert doctor.exit_code(checks) == doctor.EXIT_OK and doctor.exit_code(checks, strict=True) == doctor.EXIT_FAIL


def test_all_ranks_differences_name_the_ranks_and_values():
    a, _ = _run("cx7_roce", {"UCCL_IB_GID_INDEX": "3"})
    b, _ = _run("cx7_roce", {"UCCL_IB_GID_INDEX": "1"})
    reports = [a.report(), a.report(), b.report()]
    diff = "\n".join(doctor.differences(reports))
    assert "env UCCL_IB_GID_INDEX:" in diff and "ranks 0-1" in diff and "ranks 2" in diff
    assert doctor.differences([a.report(), a.report()]) == []


def test_all_ranks_outside_a_job_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert cli.main(["doctor", "--all-ranks", "--sysfs-root", os.path.join(FIXTURES, "no_rdma")]) == doctor.EXIT_USAGE
    assert "torchrun" in capsys.readouterr().err


def test_timeout_hint_points_to_doctor_and_state_to_inspect():
    text = doctor.timeout_hint("proxy 0 waited 100 s for tail of FIFO 3 to reach 17")
    assert text.startswith("proxy 0 waited") and "uccl-ep-train doctor" in text and "--all-ranks" in text
    assert "UCCL_EP_CPU_TIMEOUT_SECS" in doctor.TIMEOUT_HINT


def test_few_cuda_hardware_queues_are_flagged_for_loopback_runs_with_the_value_to_set():
    """CUDA_DEVICE_MAX_CONNECTIONS=1 (what Megatron launchers set) stalled the loopback's copies behind spinning
    kernels (docs/internode.md, "Hardware work queues"); the doctor says so beside the verbs checks, and names the
    value for the proxy threads configured. A recorded host's MPS state is unknown: never asked of this machine."""
    _, checks = _run("p5en", {"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    c = checks["loopback_queues"]
    assert c.status == "warn" and c.detail.startswith("CUDA_DEVICE_MAX_CONNECTIONS=1, MPS unknown: ")
    assert "1 hardware work queue(s)" in c.detail and "verbs transport is not affected" in c.detail
    assert c.fix.startswith("CUDA_DEVICE_MAX_CONNECTIONS=6 or more")
    _, checks = _run("p5en", {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "UCCL_EP_NUM_PROXY_THREADS": "8"})
    assert checks["loopback_queues"].fix.startswith("CUDA_DEVICE_MAX_CONNECTIONS=10 or more")
    _, checks = _run("p5en")
    assert checks["loopback_queues"].status == "pass" and "unset (CUDA's 8), MPS unknown" in \
        checks["loopback_queues"].detail
    _, checks = _run("p5en", {"CUDA_DEVICE_MAX_CONNECTIONS": "8"})
    assert checks["loopback_queues"].status == "pass"


def test_few_cuda_hardware_queues_pass_where_the_copy_agent_makes_the_loopback_copies():
    """The copy agent is a process of its own, so its copies never share the training process's queues: with it on,
    CUDA_DEVICE_MAX_CONNECTIONS=1 is fine; on auto the warning names the runs it still concerns (ranks sharing a
    GPU), and off names the setting."""
    _, checks = _run("p5en", {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "UCCL_EP_LOOPBACK_COPY_AGENT": "on"})
    c = checks["loopback_queues"]
    assert c.status == "pass" and "copy agent, not this process" in c.detail, c.detail
    _, checks = _run("p5en", {"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    c = checks["loopback_queues"]
    assert c.status == "warn" and "ranks that share a GPU" in c.detail, c.detail
    _, checks = _run("p5en", {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "UCCL_EP_LOOPBACK_COPY_AGENT": "off"})
    c = checks["loopback_queues"]
    assert c.status == "warn" and "UCCL_EP_LOOPBACK_COPY_AGENT=off" in c.detail, c.detail


def test_kernels_built_for_a_gpus_arch_specific_variant_pass_the_build_check_on_that_gpu():
    """Session 23: on an H100 (9.0) the module built from TORCH_CUDA_ARCH_LIST="9.0a" ("90a") failed native_build
    with "kernels are built for sm_90a"; sm_90a code runs on every 9.0 GPU. Another number still fails."""
    assert doctor.kernels_run_on("90a", "90")
    assert doctor.kernels_run_on("80;90a-real", "90")
    assert doctor.kernels_run_on("90", "90")
    assert not doctor.kernels_run_on("90a", "100")
    assert not doctor.kernels_run_on("80", "90")
