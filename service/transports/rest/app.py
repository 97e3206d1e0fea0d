"""The REST transport: a FastAPI app that maps the V2 HTTP protocol onto a :class:`DataPlane`.

Thin by design: routes decode the wire format (:mod:`.codec`), call the dataplane,
and encode the answer. Every error becomes ``{"error": "..."}`` with the HTTP code
from :data:`service.errors.STATUS_TABLE`, through :func:`error_response`.
"""
from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ... import __version__
from ...dataplane import DataPlane
from ...dataplane.repository_parameters import check_load_parameters, check_unload_parameters
from ...dataplane.unsupported import REST_PREFIXES, unsupported
from ...dataplane.validation import bool_parameter
from ...errors import InvalidInput, RNNServeError, bounded
from ...metrics import CONTENT_TYPE_LATEST
from ...metrics.processes import process_exposition
from .codec import HEADER, parameters_of, parse_json
from .infer import InferFastPath, infer_response
from .body_watch import BodyWatch
from .responses import BodyLimits, error_response, read_decoded_body
from .decode_gate import DecodeGate
from .json_process import JsonProcess
from .predict import PredictRequest, PredictResponse, decode_predict, encode_predictions


_INFER_BODY = {
    "requestBody": {
        "required": True,
        "description": "V2 inference request: JSON, or (binary tensor extension) a JSON header of "
                       f"`{HEADER}` bytes followed by raw little-endian tensors.",
        "content": {
            "application/json": {
                "schema": {"type": "object"},
                "examples": {
                    # one feature a step: what the bundled forecaster takes, so the example runs as it is
                    "json": {"summary": "two sequences of one feature, the second 1 step long (the forecaster)",
                             "value": {
                        "inputs": [
                            {"name": "input", "datatype": "FP32", "shape": [2, 3, 1],
                             "data": [0.0, 0.2, 0.39, 0.9, 0.0, 0.0]},
                            {"name": "lengths", "datatype": "INT32", "shape": [2], "data": [3, 1]}],
                        "outputs": [{"name": "output_last"}]}},
                },
            },
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
        },
    }
}


def create_rest_app(dataplane: DataPlane, max_request_bytes: int = 64 * 1024 * 1024,
                    body_timeout_s: float = 60.0) -> InferFastPath:
    """The ASGI app serving ``dataplane`` (no global state; one app per server): infer requests go straight
    to their handler, everything else to the FastAPI app (``.app``). Bodies are held to ``max_request_bytes``
    and may pause at most ``body_timeout_s`` (0: no limit)."""
    limits = BodyLimits(max_request_bytes, BodyWatch(body_timeout_s))
    # two bodies at the limit decode at once (~25 MB of memory a MB of JSON while it is decoded), in a process
    # of their own (the JSON decoder holds the GIL throughout)
    helper = JsonProcess()
    gate = DecodeGate(2 * max_request_bytes, offload=helper.run)
    app = FastAPI(
        redirect_slashes=False,  # '/v2/models/m/infer/' is an unknown path (JSON 404), not a 307 with no body
        title="rnnserve",
        version=__version__,
        description="LSTM, GRU and RNN inference over the Open Inference Protocol (KServe V2 / Triton), "
                    "plus a simple ragged-JSON `/v1/models/{model}:predict`.",
    )

    @app.exception_handler(RNNServeError)
    async def _rnnserve_error(_: Request, exc: RNNServeError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors())
        return error_response(InvalidInput(f"invalid request body: {problems}"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":  # Starlette's words for a path no route has
            message = f"no route {request.method} {request.url.path}; the routes rnnserve serves are listed at /docs"
        # its headers too: a 405 must say what is allowed (Allow, RFC 9110 15.5.6)
        return JSONResponse({"error": bounded(message)}, status_code=exc.status_code, headers=exc.headers)

    # ---- health and metadata --------------------------------------------------------------------------

    @app.get("/v2/health/live", tags=["health"], summary="Server liveness")
    async def live() -> JSONResponse:
        ok = await dataplane.live()
        return JSONResponse({"live": ok}, status_code=200 if ok else 503)

    @app.get("/v2/health/ready", tags=["health"], summary="Server readiness: every model folder tried at the start, and a version serves (or the repository "
                          "had no model)")
    async def ready() -> JSONResponse:
        ok = await dataplane.ready()
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/v2", tags=["metadata"], summary="Server metadata")
    async def server_metadata() -> dict:
        return await dataplane.server_metadata()

    # before /v2/models/{model}, which would take "stats" for a model's name
    @app.get("/v2/models/stats", tags=["statistics"], summary="Statistics of every ready model version (Triton)")
    @app.get("/v2/models/{model}/stats", tags=["statistics"], summary="Statistics of a model's ready versions")
    @app.get("/v2/models/{model}/versions/{version}/stats", tags=["statistics"], summary="Model version statistics")
    async def model_statistics(model: str = "", version: str = "") -> dict:
        return {"model_stats": await dataplane.model_statistics(model, version)}

    @app.get("/v2/models/{model}/config", tags=["metadata"], summary="Model configuration (Triton's form)")
    @app.get("/v2/models/{model}/versions/{version}/config", tags=["metadata"],
             summary="Model version configuration (Triton's form)")
    async def model_config(model: str, version: str = "") -> dict:
        return await dataplane.model_config(model, version)

    @app.get("/v2/models/{model}", tags=["metadata"], summary="Model metadata (latest ready version)")
    @app.get("/v2/models/{model}/versions/{version}", tags=["metadata"], summary="Model metadata")
    async def model_metadata(model: str, version: str = "") -> dict:
        return await dataplane.model_metadata(model, version)

    @app.get("/v2/models/{model}/ready", tags=["health"], summary="Model readiness")
    @app.get("/v2/models/{model}/versions/{version}/ready", tags=["health"], summary="Model version readiness")
    async def model_ready(model: str, version: str = "") -> JSONResponse:
        ok = await dataplane.model_ready(model, version)
        return JSONResponse({"name": model, "version": version, "ready": ok}, status_code=200 if ok else 503)

    # ---- inference -------------------------------------------------------------------------------------------

    @app.post("/v2/models/{model}/infer", tags=["inference"], summary="Infer (latest ready version)",
              openapi_extra=_INFER_BODY)
    @app.post("/v2/models/{model}/versions/{version}/infer", tags=["inference"], summary="Infer",
              openapi_extra=_INFER_BODY)
    async def infer(model: str, request: Request, version: str = "") -> Response:
        # Reached only without InferFastPath in front (it answers these paths first); kept for /docs.
        return await infer_response(dataplane, request, model, version, limits, gate)

    # The body is parsed here rather than by FastAPI so that `curl -d` without a JSON
    # content type (curl's default is form-urlencoded) still works.
    @app.post("/v1/models/{model}:predict", tags=["inference"], response_model=PredictResponse,
              summary="Predict on ragged sequences (simple JSON)",
              openapi_extra={"requestBody": {"required": True, "content": {
                  "application/json": {"schema": PredictRequest.model_json_schema()}}}})
    async def predict(model: str, request: Request) -> Response:
        """Run each instance (a list of feature vectors, any length) and return its outputs.

        `output_last` is the output at the sequence's last step (many-to-one); `output` has
        one row per step of that instance.
        """
        raw = await read_decoded_body(request, limits)
        req, lengths = await gate.decode(decode_predict, raw, model, max_request_bytes, size=len(raw))
        resp = await dataplane.infer(req)
        # encoded here rather than by FastAPI's response_model, so that a large answer leaves the event loop too
        content = await gate.encode(encode_predictions, resp, lengths, values=sum(t.data.size for t in resp.outputs))
        return Response(content, media_type="application/json")

    # ---- repository extension ---------------------------------------------------------------------------------

    @app.post("/v2/repository/index", tags=["repository"], summary="List models, versions and states")
    async def repository_index(request: Request) -> list[dict]:
        doc = await _json_or_empty(request, limits, gate)
        return await dataplane.repository_index(bool_parameter(doc, "ready", "repository index"))

    @app.post("/v2/repository/models/{model}/load", tags=["repository"], summary="Load or reload a model")
    async def load(model: str, request: Request) -> dict:
        doc = await _json_or_empty(request, limits, gate)
        check_load_parameters(model, parameters_of(doc, "load request"))
        await dataplane.load_model(model)
        return {}

    @app.post("/v2/repository/models/{model}/unload", tags=["repository"], summary="Unload a model")
    async def unload(model: str, request: Request) -> dict:
        doc = await _json_or_empty(request, limits, gate)
        check_unload_parameters(parameters_of(doc, "unload request"))
        await dataplane.unload_model(model)
        return {}

    @app.get("/metrics", tags=["metrics"], summary="Prometheus metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        processes = await asyncio.to_thread(process_exposition)  # ~20 /proc reads: off the event loop
        return Response(await dataplane.render_metrics() + processes, media_type=CONTENT_TYPE_LATEST)

    # ---- Triton extensions rnnserve does not serve: 501 with what to use instead ------------------------------

    def refuse(extension: str):
        async def unsupported_extension(request: Request) -> Response:
            raise unsupported(extension, f"{request.method} {request.url.path}")
        return unsupported_extension

    for prefix, extension in REST_PREFIXES.items():
        for path in (f"/v2/{prefix}", f"/v2/{prefix}/{{rest:path}}"):
            app.add_api_route(path, refuse(extension), methods=["GET", "POST"], include_in_schema=False)
    for path in ("/v2/models/{model}/trace/setting", "/v2/models/{model}/versions/{version}/trace/setting"):
        app.add_api_route(path, refuse("trace"), methods=["GET", "POST"], include_in_schema=False)
    for call in ("generate", "generate_stream"):  # Triton's generate extension (LLMs)
        for path in (f"/v2/models/{{model}}/{call}", f"/v2/models/{{model}}/versions/{{version}}/{call}"):
            app.add_api_route(path, refuse("generate"), methods=["POST"], include_in_schema=False)

    return InferFastPath(app, dataplane, limits, gate, close=lambda: helper.close(wait=True))


async def _json_or_empty(request: Request, limits: BodyLimits, gate: DecodeGate) -> dict:
    """A repository request's JSON object ({} for an empty body), held to the request limit like any body and
    parsed off the event loop when large (a Triton load may carry model files in its overrides)."""
    body = await read_decoded_body(request, limits)
    if not body.strip():
        return {}
    doc = await gate.decode(parse_json, body, size=len(body))
    if not isinstance(doc, dict):
        raise InvalidInput("request body must be a JSON object")
    return doc

