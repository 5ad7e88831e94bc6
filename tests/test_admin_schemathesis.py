"""Schemathesis against /admin/openapi.json with an admin key, on a live gateway and real
Redis (a single server, then a cluster): no 5xx, only documented status codes, documented
content types and response schemas, and a correct ``Allow`` header on 405. Covers every router
mounted under /admin (contexts and samples included). More examples: LEARNMESH_FUZZ_EXAMPLES=50."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.admin_support import ADMIN_KEY, live_gateway
from tests.conftest import RedisTarget

CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance," \
         "unsupported_method"


def test_schemathesis_admin_api(redis_target: RedisTarget, tmp_path: Path) -> None:
    cli = Path(sys.executable).with_name("schemathesis")
    assert cli.exists(), "pip install schemathesis (the [test] extra)"
    examples = os.environ.get("LEARNMESH_FUZZ_EXAMPLES", "5")
    with live_gateway(redis_target.url) as srv:
        proc = subprocess.run(
            [str(cli), "run", f"{srv.url}/admin/openapi.json", "-H", f"Authorization: Bearer {ADMIN_KEY}",
             "--checks", CHECKS, "--max-examples", examples, "--seed", "1", "--request-timeout", "10",
             "--workers", "1", "--no-color"],
            cwd=tmp_path, capture_output=True, text=True, timeout=280)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    tested = int(re.search(r"Tested: (\d+)", out).group(1))
    assert tested >= 25, out[-3000:]
    assert re.search(r"\d+ generated, \d+ passed", out), out[-3000:]
