"""``privalign serve`` start-up errors are one line and leave nothing behind (issue 30, item 6):
a port in use is found before anything loads or is created; the ledger's folder is created or the
reason it cannot be is named; config paths are relative to the config file; the banner prints them
absolute."""

import json
import socket
import subprocess
import sys
import urllib.request

from .test_server import STUB, Server, free_port


def serve(config, port, cwd, timeout=60):
    return subprocess.run([sys.executable, "-m", "privalign", "serve", "--config", str(config), "--port", str(port)],
                          capture_output=True, text=True, cwd=cwd, timeout=timeout)


def test_a_port_in_use_is_one_line_and_creates_no_ledger(tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    cfg = tmp_path / "c.toml"
    cfg.write_text('ledger = "state/ledger.db"\n' + STUB.format(total=5.0))
    try:
        res = serve(cfg, port, tmp_path)
    finally:
        busy.close()
    err = res.stderr.strip()
    assert res.returncode == 2 and f"--port {port}" in err and "Traceback" not in err, err
    assert len(err.splitlines()) == 1 and not (tmp_path / "state").exists()


def test_the_ledger_path_is_relative_to_the_config_file_its_folder_is_created_and_the_banner_absolute(tmp_path):
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    srv = Server(tmp_path, STUB.format(total=5.0))
    srv.config.write_text('ledger = "state/deep/ledger.db"\n' + STUB.format(total=5.0))  # relative, folders missing
    srv.cwd = str(elsewhere)
    srv.start()
    try:
        req = urllib.request.Request(srv.url + "/v1/chat/completions", method="POST", data=json.dumps(
            {"messages": [{"role": "user", "content": "hi"}]}).encode(), headers={
                "Authorization": "Bearer client-key", "Content-Type": "application/json"})
        assert urllib.request.urlopen(req, timeout=30).status == 200
    finally:
        srv.stop()
    expected = tmp_path / "state" / "deep" / "ledger.db"
    assert expected.is_file() and not (elsewhere / "state").exists()
    assert f"ledger: {expected}" in srv.log_path.read_text() and f"from {srv.config}" in srv.log_path.read_text()


def test_a_ledger_that_cannot_be_created_is_one_line_naming_it(tmp_path):
    (tmp_path / "afile").write_text("not a folder")
    cfg = tmp_path / "c.toml"
    cfg.write_text('ledger = "afile/ledger.db"\n' + STUB.format(total=5.0))
    res = serve(cfg, free_port(), tmp_path)
    err = res.stderr.strip()
    assert res.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"cannot create the folder {tmp_path / 'afile'}" in err
    cfg.write_text(f'ledger = "{tmp_path}"\n' + STUB.format(total=5.0))  # a folder, not a file
    res = serve(cfg, free_port(), tmp_path)
    assert res.returncode == 2 and "is a folder" in res.stderr and "Traceback" not in res.stderr, res.stderr
