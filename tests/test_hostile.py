"""Hostile inputs and user code that misbehaves (issue 12): never a traceback, a hang, an endless read
or a false pass; one message, the documented exit code, and files left intact."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from gradcheck_cli import scenario
from gradcheck_cli.cli import main
from gradcheck_cli.errors import ScenarioError

from helpers import examples

CORRECT = "import sys\nsys.path.insert(0, {examples!r})\nfrom my_attention import Attention\n"


def _cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _module(tmp_path, root, name, body):
    (tmp_path / f"{name}.py").write_text(CORRECT.format(examples=str(root / "examples")) + textwrap.dedent(body))


@pytest.mark.parametrize("name,body,words", [
    ("exits_on_import", "import os\nos._exit(0)\n", "exited with code 0"),
    ("exits_in_forward", """
        import os
        class Impl(Attention):
            @staticmethod
            def forward(q, k, v, visible, scale, kv_map):
                if q.shape[0] > 2:
                    os._exit(0)
                return Attention.forward(q, k, v, visible, scale, kv_map)
        impl = Impl()
        """, "exited with code 0"),
    ("kills_itself", """
        import os, signal
        class Impl(Attention):
            @staticmethod
            def backward(*args):
                os.kill(os.getpid(), signal.SIGKILL)
        impl = Impl()
        """, "killed by signal SIGKILL"),
    ("hangs", """
        import time
        class Impl(Attention):
            @staticmethod
            def forward(*args):
                while True:
                    time.sleep(0.05)
        impl = Impl()
        """, "did not finish within 2 s"),
])
@pytest.mark.slow  # subprocess workers, one waits out a 2 s time limit
def test_user_code_cannot_end_or_hang_the_run(root, tmp_path, name, body, words):
    _module(tmp_path, root, name, body)
    (tmp_path / "c.yaml").write_text(
        "defaults: {batch: 2, heads_q: 2, n_q: 4, d_head: 4}\n"
        f"scenarios:\n  - {{name: mine, implementation: '{name}:impl', check: {{timeout: 2}}}}\n"
        "  - {name: builtin}\n")
    proc = subprocess.run([sys.executable, "-m", "gradcheck_cli", "run", str(tmp_path / "c.yaml"), "--no-progress",
                           "--json", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and words in proc.stdout and "builtin: passed" in proc.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert [s["verdict"] for s in report["scenarios"]] == ["fail", "pass"]


def test_user_code_that_ends_its_worker_under_negative_controls_is_a_failed_scenario(root, tmp_path):
    """A worker that dies has no row of the negative-control matrix: the run reports the scenario failed
    and goes on (it once raised a TypeError from the missing row)."""
    _module(tmp_path, root, "exits", """
        import os
        class Impl(Attention):
            @staticmethod
            def forward(q, k, v, visible, scale, kv_map):
                os._exit(0)
        impl = Impl()
        """)
    (tmp_path / "c.yaml").write_text("defaults: {batch: 2, heads_q: 2, n_q: 4, d_head: 4}\n"
                                     "scenarios:\n  - {name: mine, implementation: 'exits:impl'}\n"
                                     "  - {name: builtin}\n")
    result = _cli("run", tmp_path / "c.yaml", "--no-progress", "--negative-controls")
    assert result.exit_code == 1 and not isinstance(result.exception, TypeError), (result.output, result.exception)
    assert "exited with code 0" in result.output and "builtin: passed" in result.output, result.output


def test_whatever_user_code_raises_or_breaks_is_its_failed_check_and_stays_in_its_scenario(root, tmp_path):
    """Exceptions the run would otherwise take for Ctrl-C or for its own errors, a process the
    implementation broke, and a module that patches NumPy: each a failed scenario (exit 1), never exit 2,
    and nothing one implementation does reaches the next scenario's process."""
    _module(tmp_path, root, "interrupts", """
        class Impl(Attention):
            @staticmethod
            def forward(*args):
                raise KeyboardInterrupt
        impl = Impl()
        """)
    _module(tmp_path, root, "badtuple", """
        class Tuple(tuple):
            def __len__(self):
                raise RuntimeError("len")
        class Impl(Attention):
            @staticmethod
            def backward(*args):
                return Tuple(Attention.backward(*args))
        impl = Impl()
        """)
    _module(tmp_path, root, "reshapes", """
        class Impl(Attention):
            @staticmethod
            def forward(q, k, v, visible, scale, kv_map):
                o = Attention.forward(q, k, v, visible, scale, kv_map)
                q.shape = (q.size,)
                return o
        impl = Impl()
        """)
    _module(tmp_path, root, "patcher", "import numpy\nnumpy.abs = lambda x, *a, **k: numpy.zeros_like(x)\n"
                                        "impl = Attention()\n")
    _module(tmp_path, root, "softmaxbug", """
        import numpy as np
        from my_attention import _probabilities
        class Impl(Attention):
            @staticmethod
            def backward(q, k, v, visible, scale, kv_map, grad_o):
                k_rep, v_rep = k[:, kv_map], v[:, kv_map]
                p = _probabilities(q, k_rep, visible, scale)
                dv = np.einsum("bhij,bhid->bhjd", p, grad_o)
                ds = p * np.einsum("bhid,bhjd->bhij", grad_o, v_rep)  # the row-sum term forgotten
                return (scale * np.einsum("bhij,bhjd->bhid", ds, k_rep),
                        scale * np.einsum("bhij,bhid->bhjd", ds, q), dv)
        impl = Impl()
        """)
    names = ["interrupts", "badtuple", "reshapes", "patcher", "softmaxbug"]
    (tmp_path / "c.yaml").write_text("defaults: {batch: 1, heads_q: 1, n_q: 3, d_head: 2}\nscenarios:\n" + "".join(
        f"  - {{name: {n}, implementation: '{n}:impl'}}\n" for n in names))
    proc = subprocess.run([sys.executable, "-m", "gradcheck_cli", "run", str(tmp_path / "c.yaml"), "--no-progress",
                           "--json", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, (proc.stdout, proc.stderr)
    report = {s["name"]: s for s in json.loads((tmp_path / "r.json").read_text())["scenarios"]}
    details = {n: " ".join(c["detail"] for c in report[n]["checks"] if c["verdict"] == "fail") for n in names}
    assert "forward raised KeyboardInterrupt" in details["interrupts"]
    assert "checking it raised RuntimeError: len" in details["badtuple"]
    assert "forward changed its argument q in place" in details["reshapes"]
    assert report["softmaxbug"]["verdict"] == "fail" and "gradient q" in {
        c["name"] for c in report["softmaxbug"]["checks"] if c["verdict"] == "fail"}


def test_overflowing_results_give_reports_and_a_merge_without_a_traceback(root, tmp_path):
    """Values near the float64 limit make non-finite errors (null in JSON): every report is written,
    merge reads it back, and NumPy's overflow warnings of the checker's own arithmetic are not shown."""
    _module(tmp_path, root, "huge", """
        class Impl(Attention):
            @staticmethod
            def forward(*args):
                return Attention.forward(*args) * 1e308
        impl = Impl()
        """)
    (tmp_path / "c.yaml").write_text("scenarios:\n"
                                     "  - {name: a, heads_q: 2, n_q: 3, d_head: 2, implementation: 'huge:impl'}\n")
    proc = subprocess.run([sys.executable, "-m", "gradcheck_cli", "run", str(tmp_path / "c.yaml"), "--no-progress",
                           "--json", str(tmp_path / "r.json"), "--junit", str(tmp_path / "r.xml")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "gradcheck_cli" not in proc.stderr  # no RuntimeWarning of ours
    assert (tmp_path / "r.xml").stat().st_size > 0
    merged = _cli("merge", tmp_path / "r.json", "--junit", tmp_path / "m.xml")
    assert merged.exit_code == 1 and "Traceback" not in merged.output


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_whose_reader_stops_reading_is_an_error_not_a_hang(tmp_path, monkeypatch):
    from gradcheck_cli.report import outputs
    monkeypatch.setattr(outputs, "STALL_S", 0.5)
    os.mkfifo(tmp_path / "f")
    reader = os.open(tmp_path / "f", os.O_RDONLY | os.O_NONBLOCK)  # holds it open, never reads
    try:  # returning at all is the proof: a writer waiting on the reader would block here for ever
        with pytest.raises(OSError, match="nothing could be written"):
            outputs._write_through(tmp_path / "f", b"x" * 2**22)
    finally:
        os.close(reader)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_workers_and_what_they_fork_do_not_keep_a_killed_run_alive(root, tmp_path):
    """kill -9 of the run: its hung worker dies too (the fork server leaves, and the workers die with it),
    even when the user's code forked a process of its own that keeps running."""
    _module(tmp_path, root, "hangs", f"""
        import os, time
        class Impl(Attention):
            @staticmethod
            def forward(*args):
                child = os.fork()
                if child == 0:
                    time.sleep(20)
                    os._exit(0)
                with open({str(tmp_path / "child")!r}, "w") as fh:
                    fh.write(str(child))
                with open({str(tmp_path / "pid")!r}, "w") as fh:
                    fh.write(str(os.getpid()))
                while True:
                    time.sleep(0.05)
        impl = Impl()
        """)
    (tmp_path / "c.yaml").write_text("scenarios:\n  - {name: a, n_q: 3, d_head: 2, implementation: 'hangs:impl'}\n")
    proc = subprocess.Popen([sys.executable, "-m", "gradcheck_cli", "run", str(tmp_path / "c.yaml"), "--no-progress"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        # the file exists once opened, before its pid is written: wait for the content (a race seen on a busy machine)
        while (not ((tmp_path / "pid").exists() and (tmp_path / "pid").read_text().strip())
               and time.monotonic() < deadline):
            time.sleep(0.05)
        worker = int((tmp_path / "pid").read_text())
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while not _gone(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert _gone(worker)
    finally:
        for pid in (worker, int((tmp_path / "child").read_text())):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="needs process groups")
def test_what_user_code_forks_ends_with_its_scenario(root, tmp_path):
    _module(tmp_path, root, "forks", f"""
        import os, time
        class Impl(Attention):
            @staticmethod
            def forward(*args):
                child = os.fork()
                if child == 0:
                    null = os.open(os.devnull, os.O_RDWR)
                    for fd in (0, 1, 2):
                        os.dup2(null, fd)
                    time.sleep(30)
                    os._exit(0)
                with open({str(tmp_path / "child")!r}, "a") as fh:
                    fh.write(f"{{child}}\\n")
                return Attention.forward(*args)
        impl = Impl()
        """)
    (tmp_path / "c.yaml").write_text("scenarios:\n  - {name: a, n_q: 3, d_head: 2, implementation: 'forks:impl'}\n")
    proc = subprocess.run([sys.executable, "-m", "gradcheck_cli", "run", str(tmp_path / "c.yaml"), "--no-progress"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    children = [int(x) for x in (tmp_path / "child").read_text().split()]
    deadline = time.monotonic() + 10
    while not all(_gone(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(c) for c in children)


def _children(pid: int) -> list[str]:
    """The command lines of the processes whose parent is ``pid`` (Linux's /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append((stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, IndexError, ValueError):
            continue  # a process that ended meanwhile
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the fork server in Linux's /proc")
@pytest.mark.parametrize("moment", ["the fork server starts", "the implementation runs"])
def test_ctrl_c_while_the_first_worker_starts_is_not_lost(root, tmp_path, moment):
    """The fork server imports NumPy and this package while the run waits for its first worker: a Ctrl-C then
    (sent as soon as the run's fork server process exists), or once the implementation runs in the worker (it
    writes a file), must end the run (130), not be swallowed into a full run that exits 0."""
    marker = tmp_path / "running"
    _module(tmp_path, root, "slow", f"""
        import time
        class Impl(Attention):
            @staticmethod
            def forward(*args):
                open({str(marker)!r}, "w").close()
                time.sleep(0.5)
                return Attention.forward(*args)
        impl = Impl()
        """)
    (tmp_path / "c.yaml").write_text("scenarios:\n  - {name: a, n_q: 3, d_head: 2, implementation: 'slow:impl'}\n")
    proc = subprocess.Popen([sys.executable, "-m", "gradcheck_cli", "run", str(tmp_path / "c.yaml"), "--no-progress",
                             "--json", str(tmp_path / "r.json")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, text=True)
    try:
        if moment == "the fork server starts":
            ready = lambda: any("forkserver" in c for c in _children(proc.pid))  # noqa: E731
        else:
            ready = marker.exists
        for _ in range(60000):  # polls (at most 10 minutes: never a verdict on time)
            if ready() or proc.poll() is not None:
                break
            time.sleep(0.01)
        assert ready(), proc.communicate()
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)  # a guard against a hang, not a measure
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, (out, err)  # the run had set its handler: it had started its fork server
    assert "Traceback" not in err and "interrupted" in err, err


def test_modules_in_the_current_folder_never_run_in_the_workers(root, tmp_path):
    """The fork server is started with 'python -c', which would put the current folder first on its
    module path: a numpy.py there must not run (here it would end the process with 7)."""
    script = Path(sys.executable).parent / "attn-gradcheck"
    if not script.exists():
        pytest.skip("the console script is not installed beside this interpreter")
    (tmp_path / "numpy.py").write_text("print('CODE FROM CWD RAN')\nimport os\nos._exit(7)\n")
    (tmp_path / "yaml.py").write_text("raise SystemExit(0)\n")
    sub = tmp_path / "sub"
    sub.mkdir()
    _module(sub, root, "mine", "impl = Attention()\n")
    (sub / "c.yaml").write_text("scenarios:\n  - {name: a, n_q: 3, d_head: 2, implementation: 'mine:impl'}\n"
                                "  - {name: b, n_q: 3, d_head: 2}\n")
    for jobs in ("1", "2"):
        proc = subprocess.run([str(script), "run", "sub/c.yaml", "--no-progress", "--jobs", jobs], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "CODE FROM CWD" not in proc.stdout + proc.stderr, (proc.stdout, proc.stderr)


def test_sweep_eps_runs_implementations_in_their_own_process(root, tmp_path):
    _module(tmp_path, root, "exits", """
        import os
        class Impl(Attention):
            @staticmethod
            def forward(*args):
                os._exit(0)
        impl = Impl()
        """)
    _module(tmp_path, root, "raises", """
        class Impl(Attention):
            @staticmethod
            def backward(*args):
                raise RuntimeError("user bug")
        impl = Impl()
        """)
    (tmp_path / "c.yaml").write_text("defaults: {n_q: 3, d_head: 2}\nscenarios:\n"
                                     "  - {name: exits, implementation: 'exits:impl'}\n"
                                     "  - {name: raises, implementation: 'raises:impl'}\n  - {name: builtin}\n")
    proc = subprocess.run([sys.executable, "-m", "gradcheck_cli", "sweep-eps", str(tmp_path / "c.yaml"),
                           "--steps", "1e-2:1e-4"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, (proc.stdout, proc.stderr)
    assert "scenario 'exits': not swept: the process checking it exited with code 0" in proc.stderr
    assert ("scenario 'raises': not swept: the implementation failed: backward raised RuntimeError: user bug"
            in proc.stderr)
    assert "builtin" in proc.stdout


def test_a_module_beside_the_config_does_not_shadow_an_installed_one(root, tmp_path):
    """A yaml.py next to the config must not replace PyYAML, here or in --jobs workers."""
    (tmp_path / "yaml.py").write_text("raise RuntimeError('the wrong yaml')\n")
    _module(tmp_path, root, "mine", "impl = Attention()\n")
    (tmp_path / "c.yaml").write_text("scenarios:\n  - {name: a, n_q: 3, d_head: 2, implementation: 'mine:impl'}\n"
                                     "  - {name: b, n_q: 3, d_head: 2}\n")
    for jobs in ("1", "2"):
        proc = subprocess.run([sys.executable, "-m", "gradcheck_cli", "run", str(tmp_path / "c.yaml"), "--no-progress",
                               "--jobs", jobs], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, (proc.stdout, proc.stderr)


def test_a_module_beside_the_config_named_like_the_installed_one_it_imports_is_told_to_be_renamed(tmp_path):
    """A recipe named like the library it wraps (x_transformers.py importing x_transformers) is imported under
    its own name and hides the library from itself: bad input saying so, not a puzzling ImportError."""
    (tmp_path / "colorsys.py").write_text("from colorsys import rgb_to_hsv\n\ndef impl(q, k, v, visible, scale, "
                                          "kv_map):\n    return rgb_to_hsv\n")
    (tmp_path / "c.yaml").write_text("scenarios:\n  - {name: a, n_q: 3, d_head: 2, implementation: 'colorsys:impl'}\n")
    proc = subprocess.run([sys.executable, "-m", "gradcheck_cli", "run", str(tmp_path / "c.yaml"), "--no-progress"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, (proc.stdout, proc.stderr)
    assert "colorsys.py in the YAML's folder has the name of the installed module 'colorsys'" in proc.stderr
    assert "rename the file" in proc.stderr


def test_an_attribute_that_raises_is_bad_input_not_a_traceback(root, tmp_path):
    (tmp_path / "raising.py").write_text("def __getattr__(name):\n    raise RuntimeError('no ' + name)\n")
    (tmp_path / "c.yaml").write_text("scenarios:\n  - {name: a, n_q: 3, d_head: 2, implementation: 'raising:impl'}\n")
    result = _cli("run", tmp_path / "c.yaml", "--no-progress")
    assert result.exit_code == 2 and "raised RuntimeError: no impl" in result.stderr
    assert "Traceback" not in result.output


def test_a_masked_array_returned_is_a_failed_check(root, tmp_path):
    _module(tmp_path, root, "masked", """
        import numpy as np
        class Impl(Attention):
            @staticmethod
            def forward(*args):
                return np.ma.masked_array(Attention.forward(*args))
        impl = Impl()
        """)
    (tmp_path / "c.yaml").write_text("scenarios:\n  - {name: a, n_q: 3, d_head: 2, implementation: 'masked:impl'}\n")
    result = _cli("run", tmp_path / "c.yaml", "--no-progress")
    assert result.exit_code == 1 and "o is a masked array" in result.stdout


@pytest.mark.parametrize("tag", ["!!python/object:os.system", "!custom", "!!set"])
def test_yaml_tags_outside_the_core_schema_are_refused_on_mappings_and_lists(tag):
    for text in (f"scenarios:\n  - {tag} {{name: a, n_q: 2, d_head: 2}}\n",
                 f"scenarios: {tag}\n  - {{name: a, n_q: 2, d_head: 2}}\n" if tag != "!!set" else
                 "scenarios:\n  - {name: a, n_q: 2, d_head: 2, kv_map: !!set {0: null}}\n"):
        with pytest.raises(ScenarioError) as err:
            scenario.loads(text, file="x.yaml")
        assert "is not allowed" in str(err.value) and err.value.line in (1, 2)


def test_sizes_are_checked_before_anything_that_size_is_built():
    import tracemalloc
    tracemalloc.start()  # NumPy's allocations are traced too
    try:
        with pytest.raises(ScenarioError, match="out of range"):
            scenario.loads("scenarios: [{name: a, n_q: 2, d_head: 2, heads_q: 2, "
                           "kv_map: [0, 100000000000000000000]}]\n")
        with pytest.raises(ScenarioError, match="serve no query head"):
            scenario.loads("scenarios: [{name: a, n_q: 2, d_head: 2, heads_q: 2, kv_map: [0, 1], "
                           "heads_kv: 10000000000000}]\n")
        with pytest.raises(ScenarioError, match="needs about"):  # no default kv_map of 1e20 heads built first
            scenario.loads("scenarios: [{name: a, n_q: 3, d_head: 2, heads_q: 100000000000000000000}]\n")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, f"{peak / 2**20:.0f} MiB allocated before the sizes were refused"
    with pytest.raises(ScenarioError) as err:
        scenario.loads("scenarios: [{name: " + "x" * 5_000_000 + "}]\n")
    assert len(str(err.value)) < 400


def test_a_sweep_whose_masks_together_exceed_the_memory_is_refused():
    text = ("scenarios:\n  - {name: a, n_q: 600, d_head: 2,\n"  # each case fits; 128 of them do not
            "     sweep: {seed: [" + ", ".join(map(str, range(128))) + "]}}\n")
    with pytest.raises(ScenarioError, match="hold masks of"):
        scenario.loads(text, memory_limit=64 * 2**20)


def test_npy_headers_are_checked_before_their_data(tmp_path):
    shape = (3, 3)

    def load(name):
        (tmp_path / "c.yaml").write_text(f"scenarios: [{{name: a, n_q: 3, d_head: 2, mask: {{visible: {name}}}}}]\n")
        return scenario.load(tmp_path / "c.yaml")

    header = (b"\x93NUMPY\x01\x00" + b"v\x00{'descr': '|b1', 'fortran_order': False, "
              b"'shape': (100000, 100000, 100000), }")
    (tmp_path / "huge.npy").write_bytes(header.ljust(128 - 1, b" ") + b"\n")
    with pytest.raises(ScenarioError, match="claims 1,000,000,000,000,000 elements"):
        load("huge.npy")
    np.savez(tmp_path / "arch.npz", m=np.ones(shape, bool))
    with pytest.raises(ScenarioError, match=r"\.npz archive"):
        load("arch.npz")
    (tmp_path / "empty.npy").write_bytes(b"")
    with pytest.raises(ScenarioError, match="is empty"):
        load("empty.npy")
    np.save(tmp_path / "ok.npy", np.tril(np.ones(shape, bool)))
    assert load("ok.npy")[0].visible.shape == (1, 1, 3, 3)
    (tmp_path / "cut.npy").write_bytes((tmp_path / "ok.npy").read_bytes()[:-4])
    with pytest.raises(ScenarioError, match="truncated"):
        load("cut.npy")
    np.save(tmp_path / "deep.npy", np.ones((1,) * 33, bool))  # beyond what numpy can broadcast
    with pytest.raises(ScenarioError, match="has 33 dimensions; a mask has at most 4"):
        load("deep.npy")
    for name, text in (("syntax", "{'descr': '|b1', 'fortran_order': False, 'shape': (3, 3"),
                       ("boolshape", "{'descr': '|b1', 'fortran_order': False, 'shape': (True, 3), }")):
        head = b"\x93NUMPY\x01\x00" + b"v\x00" + text.encode()
        (tmp_path / f"{name}.npy").write_bytes(head.ljust(127, b" ") + b"\n" + b"\x01" * 9)
        with pytest.raises(ScenarioError, match="damaged .npy header"):
            load(f"{name}.npy")
    with pytest.raises(ScenarioError, match="NUL byte"):
        load('"m\\0.npy"')
    with pytest.raises(ScenarioError, match="nested more than 4 lists deep"):
        load("[" * 40 + "true" + "]" * 40)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_special_files_never_hang_or_read_forever(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    for target in (tmp_path / "fifo", "/dev/zero", "/dev/null"):
        result = _cli("run", target)  # returning is the proof: no open() waits for a writer, no read is endless
        assert result.exit_code == 2 and "not a regular file" in result.stderr or "is empty" in result.stderr
        (tmp_path / "c.yaml").write_text(f"scenarios: [{{name: a, n_q: 3, d_head: 2, "
                                         f"mask: {{visible: '{target}'}}}}]\n")
        result = _cli("run", tmp_path / "c.yaml")
        assert result.exit_code == 2 and "Traceback" not in result.output and "mask.visible" in result.stderr
        result = _cli("merge", target)
        assert result.exit_code == 2 and "Traceback" not in result.output


@pytest.mark.slow  # a subprocess and its workers, signalled
def test_sigterm_ends_the_run_like_ctrl_c_with_143(tmp_path):
    cfg = tmp_path / "slow.yaml"
    cfg.write_text("scenarios:\n  - {name: quick, n_q: 4, d_head: 4}\n"
                   "  - {name: slow, n_q: 128, d_head: 64, heads_q: 4, check: {colouring: false}}\n")
    for jobs in ("2",):  # the parent's handling is the same with one job; workers must stop too
        report = tmp_path / f"r{jobs}.json"
        proc = subprocess.Popen([sys.executable, "-m", "gradcheck_cli", "run", str(cfg), "--no-progress", "--jobs",
                                 jobs, "--json", str(report)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        try:  # the first scenario's line is out while the second (seconds of work) runs in the other worker
            while (line := proc.stdout.readline()) and "quick: passed" not in line:
                pass
            assert "quick: passed" in line, proc.communicate()
            os.killpg(proc.pid, signal.SIGTERM)
            out, err = proc.communicate(timeout=120)  # a guard against a hang, not a measure
        finally:
            proc.kill()
            proc.wait()
        assert proc.returncode == 143 and "Traceback" not in err and "terminated after 1 of 2" in err, err
        data = json.loads(report.read_text())
        assert data["interrupted"] is True and [s["name"] for s in data["scenarios"]] == ["quick"]


def test_both_cgroup_versions_limit_the_memory(tmp_path):
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("1073741824\n")
    (v1 / "memory.usage_in_bytes").write_text("73741824\n")
    assert scenario.cgroup_room(tmp_path / "v1") == [1_000_000_000]
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert scenario.cgroup_room(tmp_path / "v1") == []
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("2000\n")
    (v2 / "memory.current").write_text("500\n")
    assert scenario.cgroup_room(v2) == [1500]
    (v2 / "memory.max").write_text("max\n")
    assert scenario.cgroup_room(v2) == []


@pytest.mark.parametrize("epsilon", ["100.0", "1.0e+300", "0.5"])
def test_an_absurd_step_is_refused_before_anything_runs(epsilon):
    with pytest.raises(ScenarioError, match="too large a step") as err:
        scenario.loads(f"scenarios: [{{name: a, n_q: 3, d_head: 2, epsilon: {epsilon}}}]\n", file="x.yaml")
    assert err.value.key == "scenarios[0].epsilon"


def test_reports_never_replace_a_file_the_run_reads(root, tmp_path):
    _module(tmp_path, root, "mine", "impl = Attention()\n")
    np.save(tmp_path / "m.npy", np.tril(np.ones((3, 3), bool)))
    (tmp_path / "c.yaml").write_text("scenarios:\n  - {name: a, n_q: 3, d_head: 2, implementation: 'mine:impl'}\n"
                                     "  - {name: b, n_q: 3, d_head: 2, mask: {visible: m.npy}}\n")
    for target in ("mine.py", "m.npy", "c.yaml"):
        before = (tmp_path / target).read_bytes()
        result = _cli("run", tmp_path / "c.yaml", "--json", tmp_path / target)
        assert result.exit_code == 2 and "would overwrite the input" in result.stderr, result.stderr
        assert (tmp_path / target).read_bytes() == before


def test_a_device_is_written_through_never_renamed_over(root):
    import stat
    result = _cli("run", root / "configs/quickstart.yaml", "--select", "causal-self", "--json", "/dev/null")
    assert result.exit_code == 0, result.output
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def _scenarios_run(monkeypatch) -> list[str]:
    """The names of the scenarios checked from now on (in this process: built-in scenarios with one job)."""
    from gradcheck_cli import checker
    real, ran = checker.run_scenario, []

    def recorded(sc, *args, **kwargs):
        ran.append(sc.name)
        return real(sc, *args, **kwargs)
    monkeypatch.setattr(checker, "run_scenario", recorded)
    return ran


def test_a_name_too_long_is_refused_before_the_run_and_staging_does_not_lengthen_names(root, tmp_path, monkeypatch):
    fits = tmp_path / ("r" * 250 + ".json")  # 255 bytes: legal, and the staged file's name is short
    result = _cli("run", root / "configs/quickstart.yaml", "--select", "causal-self", "--json", fits)
    assert result.exit_code == 0 and fits.exists(), result.output
    ran = _scenarios_run(monkeypatch)
    result = _cli("run", root / "configs/quickstart.yaml", "--json", tmp_path / ("r" * 300 + ".json"))
    assert result.exit_code == 2 and ("file name is 305 bytes" in result.stderr or "too long" in result.stderr)
    assert ran == []  # refused before the run


def test_a_config_name_too_long_for_the_file_system_is_one_line(tmp_path):
    name = str(tmp_path / ("x" * 300 + ".yaml"))
    for command in ("run", "validate", "sweep-eps"):
        result = _cli(command, name)
        assert result.exit_code == 2 and "File name too long" in result.stderr and "Traceback" not in result.output


def test_report_paths_that_are_empty_inputs_or_folders_are_refused_before_the_run(root, tmp_path, monkeypatch):
    quick = ("run", root / "configs/quickstart.yaml", "--select", "causal-self")
    (tmp_path / "helper.py").write_text("x = 1\n")  # e.g. a module an implementation imports
    (tmp_path / "arr" / "causal-self.npz").mkdir(parents=True)
    for args, words in ((("--json", ""), "an empty path"),
                        (("--json", tmp_path / "helper.py"), "a Python module"),
                        (("--junit", tmp_path / "helper.py"), "a Python module"),
                        (("--save-arrays", tmp_path / "arr"), "exists and is not a regular file")):
        ran = _scenarios_run(monkeypatch)
        result = _cli(*quick, *args)
        assert result.exit_code == 2 and words in result.stderr, result.output
        assert ran == []  # refused before the run
    assert (tmp_path / "helper.py").read_text() == "x = 1\n"


def test_errors_stay_on_one_line_and_closed_streams_do_not_change_the_verdict(root, tmp_path):
    result = _cli("run", tmp_path / "a\nb.yaml")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and "a\\nb.yaml" in result.stderr
    (tmp_path / "k.yaml").write_text("scenarios:\n  - {name: a, n_q: 3, d_head: 2, ? [1, 2] : 3}\n")
    result = _cli("validate", tmp_path / "k.yaml")
    assert result.exit_code == 2 and "keys must be names, got a list" in result.stderr
    for close in (">&-", "2>&-", ">&- 2>&-"):  # a verdict, not a traceback or a false 'check failed'
        proc = subprocess.run(f"{sys.executable} -m gradcheck_cli run {root / 'configs/quickstart.yaml'} "
                              f"--select causal-self --json {tmp_path / 'r.json'} {close}", shell=True,
                              capture_output=close == "2>&-", text=True, timeout=120)
        assert proc.returncode == 0, (close, proc.stdout, proc.stderr)
        assert json.loads((tmp_path / "r.json").read_text())["verdict"] == "pass"


def test_staged_files_of_killed_runs_are_removed_and_live_ones_and_look_alikes_kept(root, tmp_path):
    from gradcheck_cli.report import STAGE_PREFIX
    dead = tmp_path / f"{STAGE_PREFIX}999999-ab_3x9zq.tmp"  # exactly what mkstemp makes, of a gone process
    live = tmp_path / f"{STAGE_PREFIX}{os.getppid()}-abcdefgh.tmp"
    # a user's files that merely look like staged ones, one of them the run's own config
    alike = [tmp_path / f"{STAGE_PREFIX}999999-important.tmp", tmp_path / f"{STAGE_PREFIX}1-x.tmp"]
    config = tmp_path / f"{STAGE_PREFIX}999999-cfg_abcd.tmp"
    for p in (dead, live, *alike):
        p.write_text("kept")
    config.write_text((root / "configs/quickstart.yaml").read_text())
    result = _cli("run", config, "--select", "causal-self", "--json", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    assert not dead.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["r.json", live.name, config.name]
                                                                + [p.name for p in alike])


@pytest.mark.parametrize("failure", [KeyboardInterrupt, OSError])
def test_a_failed_or_interrupted_commit_puts_the_old_reports_back(tmp_path, monkeypatch, failure):
    """The second rename fails (or Ctrl-C arrives there): the first report, already renamed, goes back
    to its old content (r.json existed) or away (r.md did not): all new or all as they were."""
    from gradcheck_cli.errors import ReportsFailed, ReportsInterrupted
    from gradcheck_cli.report import outputs
    calls = {"n": 0}
    real = os.replace

    def replace(a, b):
        calls["n"] += 1
        if calls["n"] == 2:
            raise failure(5, "I/O error") if failure is OSError else failure()
        real(a, b)

    (tmp_path / "r.json").write_bytes(b"old json")
    (tmp_path / "r.xml").write_bytes(b"old xml")
    monkeypatch.setattr(outputs.os, "replace", replace)
    expected = ReportsInterrupted if failure is KeyboardInterrupt else ReportsFailed
    with pytest.raises(expected) as info:
        outputs.write_reports(tmp_path / "r.json", {"a": 1}, tmp_path / "r.xml", b"<new/>")
    assert info.value.written == [] and sorted(info.value.pending) == sorted([str(tmp_path / "r.json"),
                                                                              str(tmp_path / "r.xml")])
    assert (tmp_path / "r.json").read_bytes() == b"old json" and (tmp_path / "r.xml").read_bytes() == b"old xml"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.xml"]  # no staged or kept file left
    calls["n"] = 0
    (tmp_path / "r.json").unlink()
    with pytest.raises(expected):
        outputs.write_reports(tmp_path / "r.json", {"a": 1}, tmp_path / "r.xml", b"<new/>")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.xml"]  # the new r.json taken away again


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_without_a_reader_is_refused_before_the_run(root, tmp_path):
    os.mkfifo(tmp_path / "f")
    result = _cli("run", root / "configs/quickstart.yaml", "--json", tmp_path / "r.json", "--junit", tmp_path / "f")
    assert result.exit_code == 2 and "no reader" in result.stderr and not (tmp_path / "r.json").exists()


def _good_report(root, tmp_path):
    path = tmp_path / "good.json"
    assert _cli("run", root / "configs/quickstart.yaml", "--select", "causal-self", "--json", path).exit_code == 0
    return json.loads(path.read_text())


@pytest.mark.parametrize("mutate", [
    lambda r: r["scenarios"][0].pop("checks"),
    lambda r: r["scenarios"][0].pop("name"),
    lambda r: r.__setitem__("scenarios", [1]),
    lambda r: r.__setitem__("shard", "1/3"),
    lambda r: r["scenarios"][0].__setitem__("verdict", "maybe"),
    lambda r: r.__setitem__("summary", {"scenarios": -1}),
    lambda r: r["scenarios"][0]["checks"][0].__setitem__("passed", "yes"),
    lambda r: r.__setitem__("negative_controls", {"passed": True, "cells": [{"fault": 1}]}),
    # keys the rendering of a merge uses
    lambda r: r["scenarios"][0].pop("reproduce"),
    lambda r: r["scenarios"][0].pop("elapsed_s"),
    lambda r: r["scenarios"][0].__setitem__("elapsed_s", None),
    lambda r: r["scenarios"][0]["checks"][0].pop("diagnosis"),
    lambda r: r["scenarios"][0]["checks"][0].__setitem__("diagnosis", {"x": 1}),
    lambda r: r["scenarios"][0].__setitem__("checks", []),
    # reports that contradict themselves: a merge must not turn them into a verdict
    lambda r: r["scenarios"][0]["checks"][0].__setitem__("verdict", "fail"),
    lambda r: r["scenarios"][0].update(verdict="fail", passed=False),
    lambda r: r.__setitem__("scenarios", []),
    lambda r: r.__setitem__("shard", {"index": 5, "count": 3}),
])
def test_merge_refuses_malformed_reports_with_one_message(root, tmp_path, mutate):
    data = _good_report(root, tmp_path)
    mutate(data)
    (tmp_path / "bad.json").write_text(json.dumps(data))
    result = _cli("merge", tmp_path / "bad.json", "--json", tmp_path / "m.json")
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert any(w in result.stderr for w in ("not a valid", "contradicts itself", "no such shard")), result.stderr
    assert not (tmp_path / "m.json").exists()


def test_merge_names_missing_shards_without_counting_to_a_huge_count(root, tmp_path):
    data = _good_report(root, tmp_path)
    data["shard"] = {"index": 1, "count": 10**15, "of": None, "select": [], "deselect": []}
    (tmp_path / "s.json").write_text(json.dumps(data))
    result = _cli("merge", tmp_path / "s.json")  # returning is the proof: 10**15 shards are never listed
    assert result.exit_code == 2 and "shards 2/1000000000000000, 3/" in result.stderr and "more of" in result.stderr


@pytest.mark.parametrize("text,words", [
    ("[" * 100_000 + "]" * 100_000, "not an attn-gradcheck JSON report"),
    ('{"tool": "attn-gradcheck", "n": ' + "9" * 5000 + "}", "not an attn-gradcheck JSON report"),
    ('{"tool": "attn-gradcheck", "x": NaN}', "NaN"),
    ("\xff\xfe", "not UTF-8"),
    ('{"tool": "attn-gradcheck", "x": 1e999}', "beyond float64"),
    ('{"tool": "attn-gradcheck", "x": "\\ud800"}', "lone surrogate"),
])
def test_merge_survives_pathological_json(tmp_path, text, words):
    path = tmp_path / "bad.json"
    path.write_bytes(text.encode("latin-1") if text.startswith("\xff") else text.encode())
    result = _cli("merge", path)
    assert result.exit_code == 2 and "Traceback" not in result.output and words in result.stderr, result.output


def test_merge_fuzzed_reports_never_trace_back(root, tmp_path_factory):
    """Hypothesis over report-like JSON: any subtree of a real report replaced by any JSON value."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    folder = tmp_path_factory.mktemp("fuzz")
    base = _good_report(root, folder)
    leaves = st.one_of(st.none(), st.booleans(), st.integers(-10, 10**6), st.floats(allow_nan=False),
                       st.text(max_size=8))
    values = st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                          st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                          max_leaves=8)

    def paths(node, here=()):
        yield here
        if isinstance(node, dict):
            for k, v in node.items():
                yield from paths(v, here + (k,))
        elif isinstance(node, list):
            for i, v in enumerate(node[:3]):
                yield from paths(v, here + (i,))

    every = list(paths(base))

    @settings(max_examples=examples(1.5), suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(every), values)
    def check(path, value):
        data = json.loads(json.dumps(base))
        if path:
            node = data
            for p in path[:-1]:
                node = node[p]
            node[path[-1]] = value
        else:
            data = value
        target = folder / "f.json"
        target.write_text(json.dumps(data))
        result = _cli("merge", target)
        assert result.exit_code in (0, 1, 2, 3), result.output
        assert "Traceback" not in result.output and result.exception is None or isinstance(result.exception, SystemExit)

    check()


def test_an_error_in_user_code_says_where_it_was_raised(tmp_path):
    (tmp_path / "raises_here.py").write_text(
        "class Impl:\n"
        "    def forward(self, q, k, v, visible, scale, kv_map):\n"
        "        return q.reshape(7, -1)  # wrong\n"
        "    def backward(self, q, k, v, visible, scale, kv_map, grad_o):\n"
        "        return q, k, v\n"
        "impl = Impl()\n")
    (tmp_path / "c.yaml").write_text("scenarios:\n"
                                     "  - {name: a, n_q: 3, d_head: 2, implementation: 'raises_here:impl'}\n")
    result = _cli("run", tmp_path / "c.yaml", "--no-progress")
    assert result.exit_code == 1 and "forward raised ValueError" in result.output
    assert "raises_here.py:3 in forward)" in result.output, result.output
