"""A stand-in SGLang 0.5.23 HTTP server for CPU tests: the control plane of the real server, with the
rules taken from its source (tests/fixtures/sglang_0.5.23_contract.json names the files), and a toy
decode loop instead of a model.

What it enforces, and where SGLang does it:
- Request bodies: each route's body type from io_struct.py (required fields, Literal choices, a string
  field refuses a list -> 422, unknown keys ignored); /generate's sampling_params keys against
  api/v1/api_types.py SamplingParams (unknown keys rejected -> 400) and SamplingParams.verify's value
  rules (top_k must be -1 or >= 1, top_p in (0, 1], temperature >= 0 -> 400).
- Weight updates (managers/scheduler_components/weight_updater.py): update_weights_from_distributed is
  refused outside begin_weight_update / end_weight_update; begin refuses a second session; end refuses
  without one. The weight version moves only on an update that carries weight_version.
- Locks (managers/tokenizer_control_mixin.py): unless generation is paused, every weight-update call
  (begin, each bucket, end) takes the model-update writer lock, which waits for every running request.
- Pause (managers/scheduler.py pause_generation): abort ends running requests; retract moves them
  back to the waiting queue (their KV is freed); in_place leaves them running with their KV.
- flush_cache (scheduler.flush_cache): refused while any request runs (waiting ones count unless paused).
- /get_model_info and /get_server_info answer but are recorded as deprecated calls.
- LoRA (managers/tokenizer_control_mixin.py, lora/lora_registry.py): /load_lora_adapter and
  /unload_lora_adapter refuse without --enable-lora; a name loads once ("already exists" otherwise) from a PEFT
  directory; unload first stops new requests naming it, then waits until the requests using it have finished;
  /generate's lora_path must name a loaded adapter (400 otherwise), and each request runs on that one adapter.

The toy model: each decode step of each running request emits one token; every step is logged with
the weight-version label it carries and the set of versions of the tensors it computed with, so a
test sees any step run on half-updated weights or under a label its weights do not have.

Run: `python -m tests.sglang_standin --port N` (tests start it as a subprocess: a real HTTP server
and a real second process in the weight-update group).
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import pathlib
import typing

import torch
import torch.distributed as dist
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from megatron_rl.weight_sync.distributed import group_on_store, receive_broadcast

CONTRACT = json.loads((pathlib.Path(__file__).parent / "fixtures/sglang_0.5.23_contract.json").read_text())
STEP_S = 0.004  # toy decode step


def _check_body(body_type: str, body: typing.Any) -> str | None:
    """The pydantic/msgspec validation SGLang's route runs on its body: an error text, or None."""
    spec = CONTRACT["requests"][body_type]["fields"]
    if not isinstance(body, dict):
        return f"{body_type}: body must be an object"
    for name, field in spec.items():
        if name not in body:
            if field["required"]:
                return f"{body_type}.{name}: field required"
            continue
        value = body[name]
        optional = field["type"].startswith("Optional[")
        if value is None:
            if not optional:
                return f"{body_type}.{name}: none is not an allowed value"
            continue
        if isinstance(value, list) and not field["list"]:
            return f"{body_type}.{name}: input should be a valid {field['type']}, got a list"
        base = field["type"].removeprefix("Optional[").removesuffix("]") if optional else field["type"]
        if base == "str" and not isinstance(value, str):
            return f"{body_type}.{name}: input should be a valid string"
        if base == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            return f"{body_type}.{name}: input should be a valid integer"
        if base == "bool" and not isinstance(value, bool):
            return f"{body_type}.{name}: input should be a valid boolean"
        if "choices" in field and value not in field["choices"]:
            return f"{body_type}.{name}: input should be one of {field['choices']}"
    return None


def check_sampling_params(params: typing.Any) -> str | None:
    """/generate's sampling_params: api_types.SamplingParams keys, then SamplingParams.verify's rules."""
    allowed = CONTRACT["generate"]["SamplingParams"]["fields"]
    for one in params if isinstance(params, list) else [params or {}]:
        for key in one:
            if key not in allowed:
                return f"unknown field `{key}`"
        top_k = one.get("top_k")
        if top_k is not None and (top_k < 1 and top_k != -1):
            return f"top_k must be -1 (disable) or at least 1, got {top_k}."
        top_p = one.get("top_p")
        if top_p is not None and not 0.0 < top_p <= 1.0:
            return f"top_p must be in (0, 1], got {top_p}."
        if one.get("temperature") is not None and one["temperature"] < 0:
            return "temperature must be a non-negative finite number"
    return None


class _Req:
    def __init__(self, rid: str, prompt: list[int], max_new_tokens: int, adapter: str | None = None):
        self.rid, self.prompt, self.max_new_tokens, self.adapter = rid, prompt, max_new_tokens, adapter
        self.output: list[int] = []
        self.spans: list[dict] = []
        self.finish: dict | None = None
        self.done = asyncio.Event()


class StandIn:
    """The server's state (one TP-1 engine)."""

    def __init__(self, enable_lora: bool = False):
        self.enable_lora = enable_lora
        self.adapters: dict[str, dict] = {}  # loaded LoRA name -> its path and the sha256 of its files
        self.adapter_log: list[dict] = []  # every finished request: the adapter it ran on
        self.weights: dict[str, torch.Tensor] = {}
        self.replaced: dict[str, int] = {}  # per tensor: how many updates replaced it (equal = one model)
        self.version = "default"
        self.session = False
        self.paused: str | None = None  # the pause mode, or None
        self.running: list[_Req] = []
        self.waiting: list[_Req] = []
        self.group = None
        self.update_lock_holders = 0
        self.steps: list[dict] = []  # every decode step: its label, whether its weights were one model
        self.label_moves: list[dict] = []  # every weight_version change: whether the weights were one model
        self.calls: list[tuple[str, typing.Any]] = []
        self.deprecated_calls: list[str] = []
        self.events: list[str] = []

    def idle(self) -> bool:
        return not self.running and (self.paused is not None or not self.waiting)

    async def writer_lock(self):
        """tokenizer_manager.model_update_lock.writer_lock: waits until no generate request runs."""
        while self.running or self.waiting:
            await asyncio.sleep(STEP_S)

    async def decode_loop(self):
        while True:
            await asyncio.sleep(STEP_S)
            if self.paused is not None:
                continue
            self.running += self.waiting
            self.waiting = []
            for req in list(self.running):
                self.steps.append({"rid": req.rid, "label": self.version, "session": self.session,
                                   "consistent": len(set(self.replaced.values())) <= 1,
                                   "generation": max(self.replaced.values(), default=0)})
                token = int(sum(float(t.sum()) for t in self.weights.values())) % 97
                if req.spans and req.spans[-1]["version"] == self.version:
                    req.spans[-1]["end"] += 1
                else:
                    req.spans.append({"version": self.version, "start": len(req.output), "end": len(req.output) + 1})
                req.output.append(token)
                if len(req.output) >= req.max_new_tokens:
                    self.finish(req, {"type": "length", "length": len(req.output)})

    def adapter_users(self, name: str) -> int:
        return sum(req.adapter == name for req in self.running + self.waiting)

    def finish(self, req: _Req, reason: dict) -> None:
        req.finish = reason
        self.adapter_log.append({"rid": req.rid, "adapter": req.adapter})
        for queue in (self.running, self.waiting):
            if req in queue:
                queue.remove(req)
        req.done.set()

    def flush(self) -> bool:
        return self.idle()


def build_app(state: StandIn) -> FastAPI:
    app = FastAPI()

    def refuse(status: int, message: str) -> JSONResponse:
        state.events.append(f"{status}: {message}")
        return JSONResponse({"success": False, "message": message, "error": {"message": message}}, status_code=status)

    async def body_of(request: Request, body_type: str | None):
        raw = await request.body()
        body = json.loads(raw) if raw else {}
        state.calls.append((request.url.path, body))
        if body_type is not None:
            error = _check_body(body_type, body)
            if error:
                return None, JSONResponse({"detail": [{"msg": error}]}, status_code=422)
        return body, None

    @app.on_event("startup")
    async def start_loop() -> None:
        asyncio.get_running_loop().create_task(state.decode_loop())

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/model_info")
    async def model_info() -> dict:
        return {"model_path": "standin", "weight_version": state.version, "is_generation": True}

    @app.get("/server_info")
    async def server_info() -> dict:
        return {"version": CONTRACT["sglang_version"], "internal_states": [{"last_gen_throughput": 0.0}],
                "tp_size": 1, "weight_version": "default"}  # the launch-time value, as resolved_dict has it

    @app.get("/get_model_info")
    async def get_model_info() -> dict:
        state.deprecated_calls.append("/get_model_info")
        return await model_info()

    @app.get("/get_server_info")
    async def get_server_info() -> dict:
        state.deprecated_calls.append("/get_server_info")
        return await server_info()

    @app.post("/generate")
    async def generate(request: Request):
        body, error = await body_of(request, None)
        if error:
            return error
        unknown = sorted(set(body) - set(CONTRACT["generate"]["GenerateRequest"]["fields"]))
        if unknown:  # ignored by SGLang; recorded so a contract test sees it
            state.events.append(f"ignored /generate fields {unknown}")
        problem = check_sampling_params(body.get("sampling_params"))
        if problem:
            return JSONResponse({"error": problem}, status_code=400)
        ids = body["input_ids"]
        batch = ids and isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        rids = body.get("rid") if batch else [body.get("rid")]
        params = body.get("sampling_params") or {}
        params = params if isinstance(params, list) else [params] * len(prompts)
        lora = body.get("lora_path")
        loras = lora if isinstance(lora, list) else [lora] * len(prompts)
        named = [name for name in loras if name]
        if named and not state.enable_lora:
            return JSONResponse({"error": {"message": "LoRA is not enabled. Please set `--enable-lora`."}},
                                status_code=400)
        missing = sorted({name for name in named if not state.adapters.get(name, {}).get("accepting")})
        if missing:
            return JSONResponse({"error": {"message": f"The following requested LoRA adapters are not loaded: "
                                                      f"{missing}"}}, status_code=400)
        reqs = []
        for prompt, rid, p, adapter in zip(prompts, rids, params, loras):
            for k in range(p.get("n", 1)):
                reqs.append(_Req(rid if p.get("n", 1) == 1 else f"{rid}-{k}", prompt, p.get("max_new_tokens", 128),
                                 adapter))
        state.waiting += reqs
        for req in reqs:
            await req.done.wait()
        outs = [{"text": "", "output_ids": r.output,
                 "meta_info": {"id": r.rid, "finish_reason": r.finish, "weight_versions": r.spans,
                               "weight_version": r.spans[-1]["version"] if r.spans else state.version,
                               "output_token_logprobs": [[-1.0, t, None] for t in r.output]}} for r in reqs]
        return outs if batch else outs[0]

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body, error = await body_of(request, "AbortReq")
        if error:
            return error
        for req in list(state.running + state.waiting):
            if body.get("abort_all") or req.rid.startswith(body.get("rid") or "\0"):
                state.finish(req, {"type": "abort", "message": "Abort in waiting queue"})
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        body, error = await body_of(request, "PauseGenerationReqInput")
        if error:
            return error
        mode = body.get("mode", "abort")
        state.paused = mode
        if mode == "abort":
            for req in list(state.running + state.waiting):
                state.finish(req, {"type": "abort"})
        elif mode == "retract":  # back to the waiting queue, KV freed: recomputed after continue
            state.waiting = state.running + state.waiting
            state.running = []
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        _, error = await body_of(request, "ContinueGenerationReqInput")
        if error:
            return error
        state.paused = None
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request):
        state.calls.append(("/flush_cache", None))
        if state.flush():
            return Response("Cache flushed.\n", status_code=200)
        return Response("Cache not flushed: requests are running or queued.\n", status_code=400)

    async def locked(call):
        """tokenizer_control_mixin: paused -> run now; else under the writer lock."""
        if state.paused is None:
            await state.writer_lock()
        return await call()

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        body, error = await body_of(request, "InitWeightsUpdateGroupReqInput")
        if error:
            return error

        def join():
            store = dist.TCPStore(body["master_address"], body["master_port"], body["world_size"], False)
            state.group = group_on_store(store, body["rank_offset"], body["world_size"],
                                         group_name=body.get("group_name", "weight_update_group"),
                                         backend=body.get("backend", "nccl"))
        await asyncio.to_thread(join)
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    @app.post("/begin_weight_update")
    async def begin_weight_update(request: Request):
        _, error = await body_of(request, "BeginWeightUpdateReqInput")
        if error:
            return error

        async def call():
            if state.session:
                return refuse(400, "a weight-update session is already open; call end_weight_update() first")
            state.session = True
            state.events.append("begin")
            return {"success": True, "message": "Success"}
        return await locked(call)

    @app.post("/end_weight_update")
    async def end_weight_update(request: Request):
        _, error = await body_of(request, "EndWeightUpdateReqInput")
        if error:
            return error

        async def call():
            if not state.session:
                return refuse(400, "no weight-update session is open; call begin_weight_update() first")
            state.session = False
            state.events.append("end")
            return {"success": True, "message": "Success"}
        return await locked(call)

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        body, error = await body_of(request, "UpdateWeightsFromDistributedReqInput")
        if error:
            return error

        async def call():
            if not state.session:
                return refuse(400, "update_weights_from_distributed must run between begin_weight_update() "
                                   "and end_weight_update()")
            received = await asyncio.to_thread(receive_broadcast, state.group, body["names"], body["dtypes"],
                                               body["shapes"], backend="gloo")
            for name, tensor in received.items():
                if name not in state.replaced:
                    return refuse(400, f"no parameter named {name}")
                state.weights[name] = tensor
                state.replaced[name] += 1
            if body.get("weight_version") is not None:
                state.version = body["weight_version"]
                state.label_moves.append({"version": state.version,
                                          "consistent": len(set(state.replaced.values())) <= 1})
            state.events.append(f"bucket version={body.get('weight_version')} flush={body.get('flush_cache', True)}")
            if body.get("flush_cache", True) and not state.flush():
                return refuse(400, "Weights were updated, but the cache was not flushed because requests are "
                                   "still running or queued. Retract or finish them, then call /flush_cache.")
            return {"success": True, "message": "Succeeded to update parameter online."}
        return await locked(call)

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        body, error = await body_of(request, "UpdateWeightVersionReqInput")
        if error:
            return error
        if body.get("abort_all_requests", True):
            for req in list(state.running + state.waiting):
                state.finish(req, {"type": "abort"})
        state.version = body["new_version"]
        return {"success": True, "message": f"Weight version updated to {state.version}",
                "new_version": state.version}

    def adapter_files(path: str) -> dict | None:
        files = {}
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            if not os.path.isfile(os.path.join(path, name)):
                return None
            with open(os.path.join(path, name), "rb") as f:
                files[name] = hashlib.sha256(f.read()).hexdigest()
        return files

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body, error = await body_of(request, "LoadLoRAAdapterReqInput")
        if error:
            return error
        name = body["lora_name"]
        if not state.enable_lora:
            return JSONResponse({"success": False, "error_message": "LoRA is not enabled. Please set `--enable-lora` "
                                 "to enable LoRA."}, status_code=400)
        if name in state.adapters:
            return JSONResponse({"success": False, "error_message": f"LoRA with name {name} already exists. Loaded "
                                 f"LoRAs: {list(state.adapters)}"}, status_code=400)
        files = adapter_files(body["lora_path"])
        if files is None:
            return JSONResponse({"success": False, "error_message": f"{body['lora_path']}: no PEFT adapter"},
                                status_code=400)
        state.adapters[name] = {"path": body["lora_path"], "files": files, "accepting": True}
        return {"success": True, "loaded_adapters": {k: v["path"] for k, v in state.adapters.items()}}

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body, error = await body_of(request, "UnloadLoRAAdapterReqInput")
        if error:
            return error
        name = body["lora_name"]
        if not state.enable_lora or name not in state.adapters:
            return JSONResponse({"success": False, "error_message": f"LoRA adapter {name} is not loaded"},
                                status_code=400)
        state.adapters[name]["accepting"] = False
        while state.adapter_users(name):  # SGLang's wait_for_unload
            await asyncio.sleep(STEP_S)
        del state.adapters[name]
        state.events.append(f"unloaded {name}")
        return {"success": True, "loaded_adapters": {k: v["path"] for k, v in state.adapters.items()}}

    @app.post("/standin/model")
    async def standin_model(request: Request) -> dict:
        """The parameter names of the toy model (what a weight sync must replace, all of them)."""
        names = (await request.json())["names"]
        state.replaced = {n: 0 for n in names}
        return {"names": len(names)}

    @app.get("/standin/state")
    async def standin_state() -> dict:
        return {"steps": state.steps, "calls": state.calls, "deprecated_calls": state.deprecated_calls,
                "events": state.events, "version": state.version, "label_moves": state.label_moves,
                "session": state.session, "adapters": state.adapters, "adapter_log": state.adapter_log,
                "paused": state.paused, "running": len(state.running), "waiting": len(state.waiting),
                "checksum": {k: float(v.double().sum()) for k, v in state.weights.items()}}

    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--enable-lora", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    state = StandIn(enable_lora=args.enable_lora)
    uvicorn.run(build_app(state), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
