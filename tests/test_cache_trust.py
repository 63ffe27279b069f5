"""The cache's trust rule (volconv.device.cache): program binaries, peak.json and tune.json
planted by another user, in a folder others can write, behind a link or as a FIFO are ignored
with one warning naming them, made again, and never loaded, never written through, never waited
on."""

from __future__ import annotations

import json
import os
import pwd
import signal
import stat
import warnings
from pathlib import Path

import numpy as np
import pyopencl as cl
import pytest
from conftest import assert_spec_close, reference

from volconv.device import cache, peak, programs
from volconv.device.cache import cache_folder, device_key, read_cached, write_cached
from volconv.device.programs import PROGRAM_MAGIC, context_for, kernel_source, pack_program
from volconv.engines.direct import convolve_bank
from volconv.engines.registry import ENGINES
from volconv.plan.knobs import TUNE_FILE, TUNE_FORMAT, kernel_hash, tune_keys, tuned_knobs

PAD_LINE = "dst[at] = (DST_T)src[i0 * s0 + i1 * s1 + i2 * s2];"  # kernels/pad.cl's copy
ROWS_LINE = "d[lo2 + k] = (DST_T)s[k];"  # ... and its row kernel's (CPUs), contiguous rows


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    """A process as new (nothing warned, announced or built), the per-user cache folder in
    the test's own folder, and an alarm: a read that blocks fails the test, not the suite."""
    monkeypatch.setattr(cache, "_WARNED", set())
    monkeypatch.setattr(cache, "_PRIVATE", [])
    monkeypatch.setattr(programs, "_BUILT", [])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("VOLCONV_CACHE_DIR", raising=False)
    programs.forget_builds()

    def hung(*_):
        raise TimeoutError("a cache read blocked")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)
    programs.forget_builds()


@pytest.fixture
def nobody() -> int:
    if os.geteuid() != 0:
        pytest.skip("planting a file owned by another user needs root")
    return pwd.getpwnam("nobody").pw_uid


def ours(folder: Path) -> Path:
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder


def trust_warnings(seen) -> list[str]:
    return [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)
            and "not trusted" in str(w.message)]  # fmt: skip


class Record:
    """warnings.catch_warnings(record=True), every warning kept."""

    def __enter__(self) -> list:
        self._cm = warnings.catch_warnings(record=True)
        seen = self._cm.__enter__()
        warnings.simplefilter("always")
        return seen

    def __exit__(self, *exc: object) -> None:
        self._cm.__exit__(*exc)


# -- the rule, file by file --------------------------------------------------------------------


def plant(folder: Path, name: str, how: str, uid: int | None) -> str:
    """Put something at ``folder``/``name`` as ``how`` says; the expected reason."""
    path = folder / name
    modes = {"ours": 0o600, "other owner": 0o600, "group writable": 0o620, "other writable": 0o602}
    if how in modes:
        path.write_bytes(b"{}")
        path.chmod(modes[how])
        if how == "other owner":
            os.chown(path, uid, uid)
            return "owned by uid"
        return "" if how == "ours" else "writable by others"
    if how == "link":
        (folder / "target").write_bytes(b"{}")
        path.symlink_to(folder / "target")
        return "a symbolic link"
    if how == "fifo":
        os.mkfifo(path, 0o600)
        return "a FIFO"
    if how == "device":
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's
        return "a device"
    raise AssertionError(how)


HOW = ["other owner", "group writable", "other writable", "link", "fifo", "device"]


@pytest.mark.parametrize("how", HOW)
def test_a_file_that_fails_the_rule_is_not_read(tmp_path, how, nobody):
    folder = ours(tmp_path / "cache")
    why = plant(folder, "peak.json", how, nobody)
    with Record() as seen:
        assert read_cached(folder, "peak.json") is None
        assert read_cached(folder, "peak.json") is None  # warned once
    (said,) = trust_warnings(seen)
    assert str(folder / "peak.json") in said and why in said


def test_our_own_private_file_is_read(tmp_path):
    folder = ours(tmp_path / "cache")
    plant(folder, "peak.json", "ours", None)
    with Record() as seen:
        assert read_cached(folder, "peak.json") == b"{}"
    assert not trust_warnings(seen)


@pytest.mark.parametrize("how", ["other owner", "link", "fifo", "device"])
def test_a_write_replaces_what_was_planted_never_through_it(tmp_path, how, nobody):
    """Written through a private file renamed over the name: a planted file keeps its bytes
    (another name of it, a hard link, still reads them), a link's target is untouched."""
    folder = ours(tmp_path / "cache")
    plant(folder, "tune.json", how, nobody)
    if how == "other owner":
        os.link(folder / "tune.json", tmp_path / "planted")
    write_cached(folder, "tune.json", b'{"mine": 1}')
    st = (folder / "tune.json").lstat()
    assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077 == 0
    assert read_cached(folder, "tune.json") == b'{"mine": 1}'
    if how == "other owner":
        assert (tmp_path / "planted").read_bytes() == b"{}"
    if how == "link":
        assert (folder / "target").read_bytes() == b"{}"
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == []


# -- the rule, folder by folder ------------------------------------------------------------------


def bad_folder(tmp_path: Path, how: str, uid: int) -> tuple[Path, Path, str]:
    """A cache folder that fails the rule: (the folder to give, the path named, why)."""
    folder = tmp_path / "shared"
    if how == "sticky 1777":
        folder.mkdir()
        folder.chmod(0o1777)
        return folder, folder, "writable by others"
    if how == "other owner":
        folder.mkdir()
        os.chown(folder, uid, uid)
        return folder, folder, "owned by uid"
    if how == "link":
        ours(tmp_path / "real")
        folder.symlink_to(tmp_path / "real")
        return folder, folder, "a symbolic link"
    if how == "fifo":
        os.mkfifo(folder)
        return folder, folder, "not a folder"
    ours(folder)
    if how == "programs link":
        ours(tmp_path / "elsewhere")
        (folder / "programs").symlink_to(tmp_path / "elsewhere")
        return folder, folder / "programs", "a symbolic link"
    if how == "programs other owner":
        (folder / "programs").mkdir()
        os.chown(folder / "programs", uid, uid)
        return folder, folder / "programs", "owned by uid"
    raise AssertionError(how)


FOLDERS = ["sticky 1777", "other owner", "link", "fifo", "programs link", "programs other owner"]


@pytest.mark.parametrize("how", FOLDERS)
def test_an_untrusted_cache_folder_is_replaced_by_the_users_own(tmp_path, how, nobody):
    given, named, why = bad_folder(tmp_path, how, nobody)
    with Record() as seen:
        used = cache_folder(given)
        assert cache_folder(given) == used  # warned once
    (said,) = trust_warnings(seen)
    assert said.startswith(f"{named}:") and why in said
    assert used == tmp_path / "xdg" / "volconv" and str(used) in said
    st = used.lstat()
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077 == 0


def test_a_private_temporary_cache_when_the_users_own_fails_too(tmp_path, nobody):
    shared = tmp_path / "xdg" / "volconv"
    shared.mkdir(parents=True)
    shared.chmod(0o1777)
    with Record() as seen:
        used = cache_folder()  # the default: the per-user folder itself
    (said,) = trust_warnings(seen)
    assert str(shared) in said and used != shared and cache.is_private(used)
    assert used.stat().st_mode & 0o077 == 0 and used.stat().st_uid == os.geteuid()


# -- planted program binaries: never loaded ------------------------------------------------------


VOLUME = np.random.default_rng(21).random((18, 17, 16)).astype(np.float32)
KERNELS = np.random.default_rng(22).standard_normal((2, 3, 3, 3)).astype(np.float32)


def run(device) -> np.ndarray:
    """A run as a new process makes it (this process's programs forgotten)."""
    programs.forget_builds()
    return convolve_bank(VOLUME, KERNELS, "reflect", device=device)


def plant_pad(device, folder: Path) -> list[Path]:
    """Replace every cached pad.cl program under ``folder`` with one built from a pad.cl that
    writes 777 for every voxel, under the genuine entry's name and digest: a perfect forgery,
    which gives wrong responses wherever it is loaded."""
    ctx, _ = context_for(device)
    source = kernel_source("pad.cl")
    assert PAD_LINE in source and ROWS_LINE in source
    evil = source.replace(PAD_LINE, "dst[at] = (DST_T)777;")
    evil = evil.replace(ROWS_LINE, "d[lo2 + k] = (DST_T)777;")
    planted = []
    for path in sorted((folder / "programs").iterdir()):
        data = path.read_bytes()
        header = json.loads(data[len(PROGRAM_MAGIC) :].split(b"\n", 1)[0])
        options = header["options"]
        if programs.program_digest(device, source, options) != header["digest"]:
            continue  # another kernel's
        binary = cl.Program(ctx, evil).build(options=options).get_info(
            cl.program_info.BINARIES)[0]  # fmt: skip
        path.write_bytes(pack_program(header["digest"], binary, options))
        path.chmod(0o600)
        planted.append(path)
    assert planted
    return planted


@pytest.fixture
def forged(device, tmp_path, monkeypatch):
    """A cache folder of this user's, filled by one run, with pad.cl's programs forged; the
    control: loaded as they are (ours, private), the forgeries do give wrong responses."""
    folder = ours(tmp_path / "cache")
    monkeypatch.setenv("VOLCONV_CACHE_DIR", str(folder))
    ref = reference(VOLUME, KERNELS, "reflect")
    assert_spec_close(run(device), VOLUME, KERNELS, ref)
    planted = plant_pad(device, folder)
    assert not np.allclose(run(device), ref, atol=1e-3)  # the forgery works when trusted
    return folder, planted, ref


@pytest.mark.parametrize("how", ["other owner", "other writable", "fifo"])
def test_a_planted_binary_is_never_loaded(device, forged, how, nobody):
    _, planted, ref = forged
    for path in planted:
        if how == "other owner":
            os.chown(path, nobody, nobody)
        elif how == "other writable":
            path.chmod(0o666)
        else:
            path.unlink()
            os.mkfifo(path, 0o666)
    with Record() as seen:
        out = run(device)
    assert_spec_close(out, VOLUME, KERNELS, ref)
    said = trust_warnings(seen)
    assert sorted(said) == sorted({s for s in said}) and len(said) == len(planted)
    assert all(any(str(p) in s for s in said) for p in planted)
    for path in planted:  # replaced by this run's own build
        st = path.lstat()
        assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077
    assert_spec_close(run(device), VOLUME, KERNELS, ref)  # and loaded from there


@pytest.mark.parametrize("how", ["sticky 1777", "programs link", "programs other owner"])
def test_a_planted_binary_in_an_untrusted_folder_is_never_loaded(device, forged, how, nobody):
    folder, planted, ref = forged
    if how == "sticky 1777":
        folder.chmod(0o1777)
    elif how == "programs link":
        (folder / "programs").rename(folder / "forged")
        (folder / "programs").symlink_to(folder / "forged")
    else:
        os.chown(folder / "programs", nobody, nobody)
    with Record() as seen:
        out = run(device)
    assert_spec_close(out, VOLUME, KERNELS, ref)
    (said,) = trust_warnings(seen)
    assert said.startswith(str(folder))
    # built into the user's own cache folder instead; the shared one is left as it was
    assert list((Path(os.environ["XDG_CACHE_HOME"]) / "volconv" / "programs").iterdir())
    assert all(p.read_bytes().startswith(PROGRAM_MAGIC) for p in planted if p.exists())


# -- planted peak.json and tune.json -------------------------------------------------------------


@pytest.mark.parametrize("how", ["ours", "other owner", "other writable", "fifo", "link"])
def test_a_planted_peak_is_never_read(device, tmp_path, how, nobody, monkeypatch):
    folder = ours(tmp_path / "cache")
    key = peak._cache_key(device)
    (tmp_path / "doc").write_text(json.dumps({key: {"gflops": 12345.0}}))
    if how == "fifo":
        os.mkfifo(folder / peak.PEAK_FILE)
    elif how == "link":
        (folder / peak.PEAK_FILE).symlink_to(tmp_path / "doc")
    else:
        os.replace(tmp_path / "doc", folder / peak.PEAK_FILE)
        (folder / peak.PEAK_FILE).chmod(0o666 if how == "other writable" else 0o600)
        if how == "other owner":
            os.chown(folder / peak.PEAK_FILE, nobody, nobody)
    with Record() as seen:
        got = peak.measured_peak(device, probe=False, cache_dir=folder)
    assert got == (12345.0 if how == "ours" else None)
    assert len(trust_warnings(seen)) == (how != "ours")
    if how != "ours":  # measured again, and the planted file replaced by ours
        monkeypatch.setattr(peak, "probe_fma", lambda dev: {"gflops": 7.0})
        assert peak.measured_peak(device, cache_dir=folder) == 7.0
        st = (folder / peak.PEAK_FILE).lstat()
        assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
        assert peak.measured_peak(device, probe=False, cache_dir=folder) == 7.0


@pytest.mark.parametrize("how", ["ours", "other owner", "group writable", "fifo", "device"])
def test_a_planted_tune_entry_is_never_read(device, tmp_path, how, nobody):
    folder = ours(tmp_path / "cache")
    dev_key, bank_key = tune_keys(device, (3, 5, 3), 3, np.dtype(np.int16))
    assert dev_key == device_key(device)  # the one device key
    entry = {"format": TUNE_FORMAT, "kernel": kernel_hash(), "engine": ENGINES[0].name,
             "vector_width": 4, "unroll": 5, "rows": 1, "local_size": [2, 4]}  # fmt: skip
    if how in ("fifo", "device"):
        plant(folder, TUNE_FILE, how, nobody)
    else:
        (folder / TUNE_FILE).write_text(json.dumps({dev_key: {bank_key: entry}}))
        (folder / TUNE_FILE).chmod(0o620 if how == "group writable" else 0o600)
        if how == "other owner":
            os.chown(folder / TUNE_FILE, nobody, nobody)
    with Record() as seen:
        knobs = tuned_knobs(device, (3, 5, 3), 3, np.dtype(np.int16), cache_dir=folder)
    assert (knobs is not None and knobs["unroll"] == 5) if how == "ours" else knobs is None
    said = trust_warnings(seen)
    assert len(said) == (how != "ours") and all(str(folder / TUNE_FILE) in s for s in said)
