"""A bounded property-based run over the OpenAPI schema: no input may produce a 5xx."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from megalith_qa.config import QAConfig, ServerConfig  # noqa: E402
from megalith_qa.ingest import load_bytes  # noqa: E402
from megalith_qa.llm import ExtractiveGenerator  # noqa: E402
from megalith_qa.pipeline import build_pipeline  # noqa: E402
from megalith_qa.server import create_app  # noqa: E402


def _app():  # type: ignore[no-untyped-def]
    import tempfile

    data_dir = tempfile.mkdtemp(prefix="qa-schemathesis-")
    config = QAConfig(data_dir=data_dir, llm="extractive", server=ServerConfig(max_upload_bytes=2048))  # type: ignore[arg-type]
    pipeline = build_pipeline(config, "hashing", ExtractiveGenerator())
    pipeline.kb.ingest(
        load_bytes("seed.txt", b"The pass statement does nothing. Tea is steeped in hot water.")
    )
    return create_app(pipeline)


schema = schemathesis.openapi.from_asgi("/openapi.json", _app())


@schema.parametrize()
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_errors(case) -> None:  # type: ignore[no-untyped-def]
    case.call_and_validate(checks=[not_a_server_error])
