"""The image catalog through bcx, with the engine as its own process and images signed with
openssl over ``bcx images payload`` exactly as docs/images.md shows (and with ``bcx images sign``)."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import msgspec
import pytest
from test_engine_bcx import bcx

from better_compute.config import Settings
from better_compute.testing import ServiceProcesses


def openssl(*args: str) -> str:
    return subprocess.run(["openssl", *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    ed = tmp_path / "ed25519.pem"
    p256 = tmp_path / "p256.pem"
    openssl("genpkey", "-algorithm", "ed25519", "-out", str(ed))
    openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(p256))
    return {"ed25519": ed, "p256": p256}


def openssl_sign(tmp_path: Path, data: Path, key: Path, algorithm: str) -> Path:
    sig = tmp_path / f"{data.name}.{algorithm}.sig"
    if algorithm == "ed25519":
        openssl("pkeyutl", "-sign", "-rawin", "-inkey", str(key), "-in", str(data), "-out", str(sig))
    else:
        openssl("dgst", "-sha256", "-sign", str(key), "-out", str(sig), str(data))
    return sig


async def test_images_register_list_show_delete_through_bcx(
    bc_settings: Settings, bc_processes: ServiceProcesses, tmp_path: Path, keys: dict[str, Path]
) -> None:
    config = tmp_path / "bc.toml"
    ed_pub = openssl("pkey", "-in", str(keys["ed25519"]), "-pubout")
    p256_pub = openssl("pkey", "-in", str(keys["p256"]), "-pubout")
    config.write_text(
        "[images]\nsigners = [\n"
        f'  {{ id = "acme-release", publicKey = """{ed_pub}""" }},\n'
        f'  {{ id = "acme-p256", publicKey = """{p256_pub}""" }},\n]\n'
    )
    settings = msgspec.structs.replace(bc_settings, app="better_compute.app.default:app")
    bc_processes.settings = settings
    bc_processes.extra_env["BC_CONFIG"] = str(config)
    bc_processes.start("bc-engine")
    await bc_processes.wait_ready()

    ubuntu = tmp_path / "ubuntu.raw"
    ubuntu.write_bytes(b"\x00" * 4096 + b"ubuntu 24.04")
    flatcar = tmp_path / "flatcar.raw"
    flatcar.write_bytes(b"flatcar 3815.2.5")
    url = "https://images.example.com/ubuntu.raw"
    # the payload bcx prints, signed by openssl (docs/images.md)
    payload = tmp_path / "ubuntu.payload"
    rc, out, err = await bcx(
        settings, "images", "payload", "ubuntu-24.04@2024.06.1", "--url", url, "--file", str(ubuntu),
        "--out", str(payload),
    )  # fmt: skip
    assert rc == 0, err
    sha = hashlib.sha256(ubuntu.read_bytes()).hexdigest()
    assert payload.read_text() == (
        "better-compute image signature v1\nname: ubuntu-24.04\nversion: 2024.06.1\n"
        f"sha256: {sha}\nurl: {url}\n"
    )
    ubuntu_sig = openssl_sign(tmp_path, payload, keys["ed25519"], "ed25519")
    # a signature over the digest alone (how images were signed before issue 23) is refused, and
    # the refusal says what to do
    digest = tmp_path / "ubuntu.digest"
    digest.write_bytes(hashlib.sha256(ubuntu.read_bytes()).digest())
    old_sig = openssl_sign(tmp_path, digest, keys["ed25519"], "ed25519")
    rc, out, err = await bcx(
        settings, "images", "register", "ubuntu-24.04@2024.06.1", "--json", "--url", url,
        "--file", str(ubuntu), "--signer", "acme-release", "--signature-file", str(old_sig),
    )  # fmt: skip
    assert rc != 0
    refusal = json.loads(out or err)
    assert refusal["error"]["details"]["reason"] == "digest-only-signature", refusal
    assert "re-sign" in refusal["error"]["message"]
    rc, out, err = await bcx(
        settings, "images", "register", "ubuntu-24.04@2024.06.1", "--url", url, "--file", str(ubuntu),
        "--signer", "acme-release", "--signature-file", str(ubuntu_sig),
    )  # fmt: skip
    assert rc == 0, err
    assert "ubuntu-24.04@2024.06.1 registered" in out
    flatcar_sig = tmp_path / "flatcar.sig"  # signed by bcx itself, with the P-256 key
    rc, out, err = await bcx(
        settings, "images", "sign", "flatcar@3815.2.5", "--url", url, "--file", str(flatcar),
        "--key-file", str(keys["p256"]), "--out", str(flatcar_sig),
    )  # fmt: skip
    assert rc == 0, err
    rc, out, err = await bcx(
        settings, "images", "register", "flatcar@3815.2.5", "--json", "--public", "--url", url,
        "--file", str(flatcar), "--format", "raw.zst", "--signer", "acme-p256",
        "--signature-file", str(flatcar_sig),
    )  # fmt: skip
    assert rc == 0, err
    assert json.loads(out)["sha256"] == hashlib.sha256(flatcar.read_bytes()).hexdigest()

    # a signature of another image (another digest, version) is refused, with its reason
    rc, out, err = await bcx(
        settings, "images", "register", "ubuntu-24.04@2024.07.1", "--json", "--url", url,
        "--file", str(flatcar), "--signer", "acme-release",
        "--signature-file", str(ubuntu_sig),
    )  # fmt: skip
    assert rc != 0
    refusal = json.loads(out or err)
    assert refusal["error"]["code"] == "PERMISSION_DENIED", refusal
    assert refusal["error"]["details"]["reason"] == "bad-signature"

    rc, out, err = await bcx(settings, "images", "list")
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["IMAGE", "FROM", "FORMAT"]
    assert [line.split()[0] for line in lines[1:]] == ["flatcar@3815.2.5", "ubuntu-24.04@2024.06.1"]
    assert "allowlisted" in lines[2]
    rc, out, err = await bcx(settings, "images", "list", "--json", "--tenant", "other")
    assert [i["ref"] for i in json.loads(out)["images"]] == ["flatcar@3815.2.5"]  # public only

    rc, out, err = await bcx(settings, "images", "show", "ubuntu-24.04@2024.06.1")
    assert rc == 0, err
    assert "valid (allowlisted signer)" in out
    assert hashlib.sha256(ubuntu.read_bytes()).hexdigest() in out

    rc, out, err = await bcx(settings, "images", "delete", "ubuntu-24.04@2024.06.1", "--json")
    assert (rc, json.loads(out)) == (0, {"deleted": True})
    rc, out, err = await bcx(settings, "images", "show", "ubuntu-24.04@2024.06.1", "--json")
    assert rc != 0
    assert json.loads(out or err)["error"]["code"] == "NOT_FOUND"

    # a signer allowlisted while the engine runs: the next registration takes its signature
    ci = tmp_path / "ci.pem"
    openssl("genpkey", "-algorithm", "ed25519", "-out", str(ci))
    (tmp_path / "ci.pub").write_text(openssl("pkey", "-in", str(ci), "-pubout"))
    rc, out, err = await bcx(
        settings, "images", "signers", "add", "ops-ci", "--public-key-file", str(tmp_path / "ci.pub")
    )
    assert rc == 0, err
    assert "signer ops-ci (ed25519) allowlisted" in out
    tools_sig = tmp_path / "tools.sig"
    rc, out, err = await bcx(
        settings, "images", "sign", "tools@1", "--url", url, "--file", str(flatcar), "--key-file", str(ci),
        "--out", str(tools_sig),
    )  # fmt: skip
    assert rc == 0, err
    rc, out, err = await bcx(
        settings, "images", "register", "tools@1", "--url", url, "--file", str(flatcar), "--signer", "ops-ci",
        "--signature-file", str(tools_sig),
    )  # fmt: skip
    assert rc == 0, err
    rc, out, err = await bcx(settings, "images", "signers", "list")
    assert rc == 0, err
    rows = [line.split()[:3] for line in out.splitlines()]
    assert rows == [
        ["ID", "ALGORITHM", "SOURCE"], ["acme-p256", "ecdsa-p256-sha256", "config"],
        ["acme-release", "ed25519", "config"], ["ops-ci", "ed25519", "operator"],
    ]  # fmt: skip
