"""The ramdisk builder's own pieces, without packages: the cpio (newc) archive as GNU cpio reads
it back, modules.dep in the order modprobe loads, and ``[ramdisk]`` in bc.toml naming the ramdisk
the shipped profiles boot. The whole build and a VM booting it: tests/e2e/test_ramdisk_vm.py."""

from __future__ import annotations

import gzip
import subprocess
from pathlib import Path

import pytest
import zstandard

from better_compute.config import parse_settings
from better_compute.core.errors import BcError
from better_compute.metal import metal
from better_compute.metal.module import configured_ramdisk
from better_compute.runtime.ramdisk import Tree, _load_order, _Modules, _modules_dep, write_cpio

pytestmark = pytest.mark.integration

SHA = "ab" * 32


def _listing(archive: bytes) -> list[str]:
    done = subprocess.run(["cpio", "-itv", "--quiet"], input=archive, capture_output=True, check=True)
    return done.stdout.decode().splitlines()


@pytest.mark.parametrize("compress", ["zstd", "gzip"])
def test_the_initramfs_is_a_newc_cpio_with_device_nodes_made_without_root(
    tmp_path: Path, compress: str
) -> None:
    tree = Tree()
    tree.device("/dev/console", "char", 5, 1)
    tree.file("/init", data=b"#!/bin/sh\necho hi\n", mode=0o755)
    tree.file("/etc/bcd/odd", data=b"x" * 5)  # a size that needs padding
    tree.symlink("/bin/sh", "busybox")
    out = tmp_path / "initrd.img"
    write_cpio(tree, out, compress=compress)  # type: ignore[arg-type]
    packed = out.read_bytes()
    if compress == "zstd":
        assert packed[:4] == b"\x28\xb5\x2f\xfd"  # what the kernel's RD_ZSTD unpacks
        raw = zstandard.ZstdDecompressor().stream_reader(packed).read()
    else:
        raw = gzip.decompress(packed)
    lines = _listing(raw)
    by_name = {line.split()[-1] if "->" not in line else line.split()[-3]: line for line in lines}
    assert by_name["dev/console"].startswith("crw-------")
    assert "5,   1" in by_name["dev/console"] or "5, 1" in by_name["dev/console"]
    assert by_name["init"].startswith("-rwxr-xr-x")
    assert by_name["bin/sh"].startswith("lrwxrwxrwx")
    assert by_name["dev"].startswith("drwxr-xr-x")  # parents made
    assert {"etc", "etc/bcd", "etc/bcd/odd", "bin"} <= set(by_name)
    extract = tmp_path / "x"
    extract.mkdir()
    subprocess.run(["cpio", "-id", "--quiet", "etc/bcd/odd", "init"], input=raw, cwd=extract, check=True)
    assert (extract / "etc/bcd/odd").read_bytes() == b"xxxxx"
    assert (extract / "init").read_bytes() == b"#!/bin/sh\necho hi\n"
    again = tmp_path / "again.img"
    write_cpio(tree, again, compress=compress)  # type: ignore[arg-type]
    assert again.read_bytes() == packed  # the same tree gives the same bytes


def test_modules_dep_lists_what_a_module_needs_so_modprobe_loads_it_first(tmp_path: Path) -> None:
    # a needs c and b, b needs c: c must load before b, b before a
    files = {n: tmp_path / "kernel" / f"{n}.ko" for n in ("a", "b", "c", "d")}
    mods = _Modules(files=files, deps={"a": ["c", "b"], "b": ["c"], "c": [], "d": []}, aliases={}, missing=[])
    assert _load_order(mods, ["c", "b"]) == ["c", "b"]
    lines = dict(line.split(":", 1) for line in _modules_dep(mods, tmp_path).splitlines())
    # modprobe loads the listed modules from the last to the first, then the module itself
    assert lines["kernel/a.ko"].split() == ["kernel/b.ko", "kernel/c.ko"]
    assert lines["kernel/b.ko"].split() == ["kernel/c.ko"]
    assert lines["kernel/d.ko"] == ""


def test_bc_toml_names_the_ramdisk_the_shipped_profiles_boot(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = parse_settings(
        {"ramdisk": {"kernel": "http://files.lab/vmlinuz", "kernel_sha256": SHA, "cmdline": "console=ttyS0",
                     "initrd": "http://files.lab/initrd.img", "initrd_sha256": SHA}}
    )  # fmt: skip
    ramdisk = configured_ramdisk(settings.ramdisk)
    assert ramdisk is not None
    assert ramdisk.to_with() == {
        "kernel": "http://files.lab/vmlinuz", "initrd": "http://files.lab/initrd.img",
        "kernelSha256": SHA, "initrdSha256": SHA, "cmdline": "console=ttyS0",
    }  # fmt: skip
    assert configured_ramdisk(parse_settings({}).ramdisk) is None

    # the default app's metal() reads it from the process's settings (bc.toml, BC_RAMDISK_*)
    monkeypatch.setenv("BC_RAMDISK_KERNEL", "http://files.lab/other-vmlinuz")
    inspect = next(p for p in metal().profiles if p.id == "metal.inspect")
    boot = next(s for s in inspect.steps if s.use == "metal.ensureRamdisk")
    assert boot.with_ == {"kernel": "http://files.lab/other-vmlinuz"}
    monkeypatch.delenv("BC_RAMDISK_KERNEL")
    inspect = next(p for p in metal().profiles if p.id == "metal.inspect")
    assert next(s for s in inspect.steps if s.use == "metal.ensureRamdisk").with_ == {}


@pytest.mark.parametrize(
    ("key", "value"),
    [("kernel", "file:///srv/vmlinuz"), ("kernel_sha256", "ABC"), ("initrd", "ftp://x/initrd")],
)
def test_a_bad_ramdisk_setting_is_refused_at_its_path(key: str, value: str) -> None:
    with pytest.raises(BcError) as err:
        parse_settings({"ramdisk": {key: value}})
    assert err.value.code.value == "INVALID_CONFIG"
    assert err.value.path == f"ramdisk.{key}"
