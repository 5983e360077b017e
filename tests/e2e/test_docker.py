"""The Docker deployment end to end, as docs/deployment.md ("Docker") runs it: build
docker/Dockerfile on a base made from Debian's packages, start docker/compose.yml (a SuperLink
with TLS and SuperNode authentication on 127.0.0.1, its Fleet gateway, two organisations' SuperNodes
and pinned SuperExecs; host networking, each service on its own loopback port), register the two
keys, run two rounds of PromptFL under local DP (every node states a privacy limit), check
`python -m fedvlm.status` in the SuperLink's container, and see an unregistered SuperNode refused.
It prints the build time, the image size and the run time (the "Docker" figures of
docs/results/deployment.md).

Skipped, with the reason, where no Docker engine answers, where the base image is missing (the
mmdebstrap recipe makes it), or where the test cannot hand the key files to the containers' user
(uid 10000 for the federation's side, 10001 for the organisations') without root. It takes tens of
minutes and several GB: it is not in CI.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedvlm.deploy.credentials import generate
from fedvlm.deploy.pinned_app import build_hash
from fedvlm.utils.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
BASE = os.environ.get("FEDVLM_BASE_IMAGE", "fedvlm-base:bookworm")
IMAGE = "fedvlm:e2e"
UID, FEDERATION_UID = 10001, 10000


def _ok(*cmd: str) -> bool:
    return shutil.which(cmd[0]) is not None and subprocess.run(cmd, capture_output=True).returncode == 0


def _buildkit_docker() -> tuple[str, dict]:
    """A docker CLI that builds with BuildKit (the documented DOCKER_BUILDKIT=1: built into
    Debian's 20.10, a newer CLI needs buildx), and its environment; else the classic builder."""
    for cli in dict.fromkeys(c for c in (shutil.which("docker"), "/usr/bin/docker") if c and Path(c).exists()):
        if _ok(cli, "buildx", "version"):
            return cli, {"DOCKER_BUILDKIT": "1"}
        version = subprocess.run([cli, "version", "--format", "{{.Client.Version}}"], capture_output=True, text=True)
        if version.stdout[:2].isdigit() and int(version.stdout[:2]) < 23:
            return cli, {"DOCKER_BUILDKIT": "1"}
    return "docker", {"DOCKER_BUILDKIT": "0"}


def _tools(uid: int, gid: int) -> list[str]:
    """docs/deployment.md's `fedvlm` helper: the image's tools, as the operator, on the checkout."""
    return [
        "docker",
        "run",
        "--rm",
        "--network",
        "host",
        "-u",
        f"{uid}:{gid}",
        "-e",
        "HOME=/tmp",
        "-e",
        "FEDVLM_CACHE=/tmp/cache",
        "-v",
        f"{ROOT}:/src",
        "-w",
        "/src/docker",
        IMAGE,
    ]


def _compose() -> list[str]:
    return ["docker", "compose"] if _ok("docker", "compose", "version") else ["docker-compose"]


pytestmark = [
    pytest.mark.skipif(not _ok("docker", "info"), reason="no Docker engine answers (`docker info` fails)"),
    pytest.mark.skipif(
        not _ok("docker", "compose", "version") and shutil.which("docker-compose") is None,
        reason="neither `docker compose` nor `docker-compose` is installed",
    ),
    pytest.mark.skipif(os.geteuid() != 0, reason="handing the keys to the containers' uids needs root"),
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if not _ok("docker", "image", "inspect", BASE):
        pytest.skip(
            f"base image {BASE} is missing: mmdebstrap --variant=minbase --include=python3,python3-venv,"
            f"ca-certificates bookworm base.tar && docker import base.tar {BASE}"
        )
    from fedvlm.deploy.export_folder import export_partitions

    work = tmp_path_factory.mktemp("docker")
    creds, data, secrets = work / "credentials", work / "data", work / "secrets"
    old_umask = os.umask(0o077)  # the operator's files are owner-only, as the image's tools make them
    try:
        generate(creds, [], [], ["org-0", "org-1", "intruder"])
        export_partitions(data, 2)
        secrets.mkdir()
        for org in ("org-0", "org-1"):
            (secrets / org).write_bytes(os.urandom(32))
    finally:
        os.umask(old_umask)
    # docs/deployment.md, "Docker", step 3: the keys to the containers' accounts, the data to their group
    for path in [creds / "server.key", creds / "server-signing.key"]:
        os.chown(path, FEDERATION_UID, -1)
    for path in [*secrets.iterdir(), creds / "supernodes" / "org-0", creds / "supernodes" / "org-1"]:
        os.chown(path, UID, -1)
    for path in [data, *data.rglob("*")]:
        os.chown(path, -1, UID)
        path.chmod(path.stat().st_mode | (0o050 if path.is_dir() else 0o040))
    ports = {k: str(free_port()) for k in ("SUPERLINK_PORT", "GATEWAY_PORT", "NODE0_PORT", "NODE1_PORT")}
    env = {
        **os.environ,
        **ports,
        "FEDVLM_IMAGE": IMAGE,
        "BASE_IMAGE": BASE,
        "FEDVLM_CREDENTIALS": str(creds),
        "FEDVLM_DATA": str(data),
        "FEDVLM_SECRETS": str(secrets),
        "RESEARCHER_UID": str(os.getuid()),  # the account whose flwr reaches the SuperLink
    }
    # the build of step 1, its arguments as the documented command passes them: a site whose proxy
    # intercepts TLS (this project's own machines) passes its CA as `$(cat ...)` does (trailing
    # newlines cut), so that the operator's layer cache is this test's
    extra_ca = "".join(p.read_text() for p in sorted(Path("/usr/local/share/ca-certificates").glob("*.crt")))
    docker, build_env = _buildkit_docker()
    t0 = time.time()
    build = subprocess.run(
        [
            docker,
            "build",
            "--network",
            "host",
            "-f",
            "docker/Dockerfile",
            "-t",
            IMAGE,
            "--build-arg",
            f"BASE_IMAGE={BASE}",
            "--build-arg",
            f"EXTRA_CA_CERTS={extra_ca.rstrip(chr(10))}",
            "--build-arg",
            "EMBEDDED_PROMPT=1",
            "--build-arg",
            "EMBEDDED_VLM=0",
            "--build-arg",
            "EMBEDDED_REPROGRAM=0",
            ".",
        ],
        cwd=ROOT,
        env={**os.environ, **build_env},
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    built = time.time() - t0
    size = int(
        subprocess.run(["docker", "image", "inspect", "-f", "{{.Size}}", IMAGE], capture_output=True, text=True).stdout
    )
    # step 2's pin, computed by the image's own tools on the checkout, is the host's
    pin = subprocess.run(
        [*_tools(os.getuid(), os.getgid()), "python", "-m", "fedvlm.deploy.pinned_app", "hash", "/src"],
        capture_output=True,
        text=True,
    )
    assert pin.returncode == 0, pin.stderr
    assert pin.stdout.split()[0].removeprefix("sha256:") == build_hash(ROOT)[0], pin.stdout
    env["APP_PIN"] = pin.stdout.split()[0]
    compose = [*_compose(), "-p", "fedvlm-e2e", "-f", str(ROOT / "docker" / "compose.yml")]
    up = subprocess.run([*compose, "up", "-d"], env=env, capture_output=True, text=True)
    try:
        assert up.returncode == 0, up.stderr
        home = work / "flwr-home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "docker"\n\n[superlink.docker]\naddress = "127.0.0.1:{ports["SUPERLINK_PORT"]}"\n'
            f'root-certificates = "{creds / "ca.crt"}"\n'
        )
        flwr_env = {**env, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
        yield {"env": env, "flwr_env": flwr_env, "compose": compose, "work": work, "built": built, "size": size}
    finally:
        logs = subprocess.run([*compose, "logs", "--no-color", "--tail", "40"], env=env, capture_output=True, text=True)
        print(logs.stdout[-6000:])
        subprocess.run([*compose, "down", "-v"], env=env, capture_output=True)


def _flwr(stack, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "flwr"), *args], env=stack["flwr_env"], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_the_image_builds_and_the_compose_federation_finishes_a_dp_run(stack):
    creds = Path(stack["env"]["FEDVLM_CREDENTIALS"])
    deadline = time.time() + 180
    for org in ("org-0", "org-1"):  # the SuperLink may still be starting
        while True:
            reg = _flwr(
                stack, "supernode", "register", str(creds / "supernodes" / f"{org}.pub"), "docker", "--name", org
            )
            if reg.returncode == 0 or time.time() > deadline:
                break
            time.sleep(3)
        assert reg.returncode == 0, reg.stdout + reg.stderr
    deadline = time.time() + 300
    while time.time() < deadline:
        nodes = _flwr(stack, "supernode", "list", "docker", "--format", "json")
        if nodes.returncode == 0 and sum(n["status"] == "online" for n in json.loads(nodes.stdout)["nodes"]) == 2:
            break
        time.sleep(3)
    t0 = time.time()
    run = _flwr(
        stack,
        "run",
        ".",
        "docker",
        "--stream",
        "--run-config",
        "method='promptfl' privacy.epsilon=1 num-server-rounds=2 min-nodes=2 round-timeout=600 run-name='e2e'",
        timeout=1800,
    )
    ran = time.time() - t0
    status = subprocess.run(
        [
            *stack["compose"],
            "exec",
            "-T",
            "superlink",
            "python",
            "-m",
            "fedvlm.status",
            "/home/federation/fedvlm-runs/e2e",
        ],
        env=stack["env"],
        capture_output=True,
        text=True,
    )
    assert status.returncode == 0, status.stdout + status.stderr + run.stdout[-4000:]
    print(
        f"\nDocker: image built in {stack['built']:.0f} s, {stack['size'] / 2**30:.2f} GiB; a 2-round PromptFL run on "
        f"two organisations finished in {ran:.0f} s"
    )
    # every container: an init as PID 1 that reaped the finished ServerApp and ClientApps, and a
    # read-only root (not even its own home is writable); no warning about a cache it cannot write
    # (after 5 s: a finished ServerApp stayed a zombie for 20-60 s, a look right away missed it)
    probe = (
        "import pathlib, time; time.sleep(5); p = pathlib.Path('/proc'); "
        "print(p.joinpath('1', 'cmdline').read_bytes().split(b'\\0')[0].decode()); "
        "print(sum(') Z ' in q.joinpath('stat').read_text() for q in p.iterdir() if q.name.isdigit())); "
        "import os; print(os.access(os.path.expanduser('~'), os.W_OK), os.access('/tmp', os.W_OK))"
    )
    for service in ("superlink", "exec-0", "worker-1"):
        got = subprocess.run(
            [*stack["compose"], "exec", "-T", service, "python", "-c", probe],
            env=stack["env"],
            capture_output=True,
            text=True,
        )
        init, zombies, home, tmp = got.stdout.split()
        assert "init" in init and zombies == "0" and (home, tmp) == ("False", "True"), (service, got.stdout, got.stderr)
    logs = subprocess.run([*stack["compose"], "logs", "--no-color"], env=stack["env"], capture_output=True, text=True)
    assert "Matplotlib created a temporary" not in logs.stdout and "is not a writable directory" not in logs.stdout


def test_a_family_the_image_was_built_without_is_refused_with_the_build_argument(stack):
    """The image bakes only the prompt family's model (compose.yml's default): the tiny VLM is not
    pretrained for minutes on a node, it is refused with the build argument that adds it."""
    got = subprocess.run(
        [
            "docker",
            "run",
            "--rm",
            "--network",
            "host",
            IMAGE,
            "python",
            "-c",
            "from pathlib import Path; from fedvlm.models import tiny_clip, tiny_vlm; "
            "tiny_clip.load_embedded_clip(Path('/home/app/.cache/fedvlm')); print('clip baked', flush=True); "
            "tiny_vlm.ensure_pretrained(Path('/home/app/.cache/fedvlm'))",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert got.returncode != 0 and got.stdout.strip() == "clip baked", got.stdout + got.stderr[-2000:]
    assert "NotInImage" in got.stderr and "--build-arg EMBEDDED_VLM=1" in got.stderr, got.stderr[-2000:]


def test_an_unregistered_supernode_is_refused(stack):
    creds = Path(stack["env"]["FEDVLM_CREDENTIALS"])
    os.chown(creds / "supernodes" / "intruder", UID, UID)
    intruder = subprocess.run(
        [
            "docker",
            "run",
            "--rm",
            "--network",
            "host",
            "--user",
            str(UID),
            "-v",
            f"{creds / 'ca.crt'}:/credentials/ca.crt:ro",
            "-v",
            f"{creds / 'supernodes' / 'intruder'}:/credentials/supernode.key:ro",
            IMAGE,
            "flower-supernode",
            f"--superlink=127.0.0.1:{stack['env']['GATEWAY_PORT']}",
            "--root-certificates=/credentials/ca.crt",
            "--auth-supernode-private-key=/credentials/supernode.key",
            "--max-retries=2",
            f"--port={free_port()}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert intruder.returncode != 0, (intruder.stdout + intruder.stderr)[-3000:]
    assert "Failed to activate SuperNode" in intruder.stdout + intruder.stderr, intruder.stderr[-3000:]


def test_an_organisations_container_reaches_no_superlink_api(stack):
    """The organisations' containers share the host's network, and so its loopback: the SuperLink
    serves only the federation's account and the researcher's (deploy.superlink), so a container
    of an organisation's uid is refused the Control API and the ServerApp's tasks alike."""
    creds = Path(stack["env"]["FEDVLM_CREDENTIALS"])
    port = stack["env"]["SUPERLINK_PORT"]
    deadline = time.time() + 180
    while _flwr(stack, "ls", "docker").returncode != 0:  # the SuperLink may still be starting: the researcher's view
        assert time.time() < deadline, "the SuperLink never answered the researcher"
        time.sleep(3)
    probe = (
        "import httpx, ssl; ctx = ssl.create_default_context(cafile='/credentials/ca.crt'); "
        f"print([httpx.post('https://127.0.0.1:{port}' + p, content=b'', verify=ctx).status_code "
        "for p in ('/v1/control/list-runs', '/v1/runtime/acquire-task')])"
    )
    got = subprocess.run(
        [
            "docker",
            "run",
            "--rm",
            "--network",
            "host",
            "--user",
            str(UID),
            "-v",
            f"{creds / 'ca.crt'}:/credentials/ca.crt:ro",
            IMAGE,
            "python",
            "-c",
            probe,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert got.stdout.strip() == "[403, 403]", got.stdout + got.stderr[-2000:]
    logs = subprocess.run(
        [*stack["compose"], "logs", "--no-color", "superlink"], env=stack["env"], capture_output=True, text=True
    )
    assert f"the calling socket belongs to uid {UID}" in logs.stdout, logs.stdout[-3000:]
