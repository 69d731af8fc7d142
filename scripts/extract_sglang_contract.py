"""Extract SGLang's HTTP/engine contract from its wheel into tests/fixtures/sglang_<version>_contract.json.

Run once per SGLang version we target (nothing is downloaded at test time):

    pip download --no-deps sglang==0.5.23 -d /tmp && unzip -q /tmp/sglang-0.5.23-*.whl -d /tmp/sgl
    python scripts/extract_sglang_contract.py /tmp/sgl [--server-flags FLAGS.txt]

Where each part comes from (all read from the unpacked wheel's source with `ast`, never imported:
`sglang.srt.managers.io_struct` does not import without a CUDA build of torchvision):
- "requests": the msgspec request structs of sglang/srt/managers/io_struct.py (fields, whether required,
  Literal choices, and whether the type admits a list), with BaseReq's own fields (rid, http_worker_ipc).
- "generate": GenerateRequest and SamplingParams of sglang/api/v1/api_types.py (the generated JSON
  contract /generate checks before anything else: it type-checks the keys it knows and ignores the
  others; SamplingParams rejects unknown keys). The handler then parses the body as io_struct's
  GenerateReqInput (in "requests"), which holds fields the pre-check does not know (return_routed_experts).
- "routes": every route of sglang/srt/entrypoints/http_server.py with its methods, its body type and
  whether its docstring calls it deprecated.
- "server_flags": the `--flag` names of `sglang.launch_server`. `sglang.srt.server_args` does import
  with light dependencies (msgspec, orjson, pyzmq, pybase64, aiohttp), so the list is taken from
  `ServerArgs.add_cli_args` on an argparse parser when it imports (pass --server-flags with a file of
  one flag per line produced that way elsewhere), else approximated from the field names of
  sglang/srt/arg_groups/fields/*.py (`--` + name with dashes; aliases and renamed flags are missed, so
  the vendored fixture uses the argparse list).
"""
from __future__ import annotations

import argparse
import ast
import json
import pathlib
import re
import sys

REQUEST_STRUCTS = (
    "AbortReq", "BeginWeightUpdateReqInput", "EndWeightUpdateReqInput", "UpdateWeightsFromDistributedReqInput",
    "UpdateWeightsFromTensorReqInput", "InitWeightsUpdateGroupReqInput", "DestroyWeightsUpdateGroupReqInput",
    "UpdateWeightVersionReqInput", "PauseGenerationReqInput", "ContinueGenerationReqInput",
    "ReleaseMemoryOccupationReqInput", "ResumeMemoryOccupationReqInput", "FlushCacheReqInput",
    "UpdateWeightFromDiskReqInput", "CheckWeightsReqInput", "LoadLoRAAdapterReqInput", "UnloadLoRAAdapterReqInput",
    "GenerateReqInput",  # what /generate's handler parses (GenerateRequest below is only its pre-check)
)
BASE_FIELDS = {"BaseReq": ["rid", "http_worker_ipc"]}


def _annotation_facts(node: ast.expr) -> dict:
    text = ast.unparse(node)
    facts = {"type": text, "list": bool(re.search(r"\bList\[|\blist\[|OrList\b", text))}
    literal = re.search(r"Literal\[(.*?)\]", text)
    if literal:
        facts["choices"] = [ast.literal_eval(x.strip()) for x in literal.group(1).split(",")]
    return facts


def _class_fields(tree: ast.Module, names: tuple[str, ...] | None = None) -> dict:
    out = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef) or (names is not None and node.name not in names):
            continue
        fields = {}
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                fields[item.target.id] = {**_annotation_facts(item.annotation), "required": item.value is None}
        bases = [ast.unparse(b) for b in node.bases]
        doc = ast.get_docstring(node) or ""
        out[node.name] = {"bases": bases, "fields": fields,
                          "unknown_keys": "rejected" if "unknown keys rejected" in doc else "ignored"}
    return out


def _routes(tree: ast.Module) -> dict:
    routes = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.AsyncFunctionDef):
            continue
        doc = (ast.get_docstring(node) or "").lower()
        body_type = None
        for arg in node.args.args:
            if arg.annotation is not None:
                text = ast.unparse(arg.annotation)
                match = (re.search(r"Annotated\[(\w+),\s*Body\(\)\]", text)
                         or re.fullmatch(r"(\w+(?:ReqInput|Req))", text))
                if match:
                    body_type = match.group(1)
        for deco in node.decorator_list:
            if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)
                    and ast.unparse(deco.func.value) == "app" and deco.args
                    and isinstance(deco.args[0], ast.Constant)):
                continue
            kind = deco.func.attr
            methods = [kind.upper()] if kind in ("get", "post", "put", "delete") else []
            for kw in deco.keywords:
                if kw.arg == "methods":
                    methods = ast.literal_eval(kw.value)
            routes[deco.args[0].value] = {"methods": sorted(methods), "handler": node.name, "body": body_type,
                                          "deprecated": "deprecated" in doc}
    return routes


def _field_flags(fields_dir: pathlib.Path) -> list[str]:
    flags = set()
    for path in sorted(fields_dir.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) \
                            and not item.target.id.startswith("_"):
                        flags.add("--" + item.target.id.replace("_", "-"))
    return sorted(flags)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=pathlib.Path, help="the unpacked sglang wheel (holds sglang/ and the dist-info)")
    parser.add_argument("--server-flags", type=pathlib.Path, help="file of flags from ServerArgs.add_cli_args")
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args(argv)
    dist_info = next(args.root.glob("sglang-*.dist-info"))
    version = dist_info.name.removesuffix(".dist-info").split("-")[1]
    metadata = (dist_info / "METADATA").read_text()
    pins = sorted(line.split(": ", 1)[1] for line in metadata.splitlines()
                  if line.startswith("Requires-Dist: ") and "extra ==" not in line
                  and re.match(r"Requires-Dist: (torch|triton|transformers|tokenizers|flashinfer|sglang-kernel|"
                               r"torch_memory_saver)\b", line))
    src = args.root / "sglang"
    io_tree = ast.parse((src / "srt/managers/io_struct.py").read_text())
    requests = _class_fields(io_tree, REQUEST_STRUCTS)
    for struct in requests.values():  # BaseReq's own fields, inherited by every request
        if "BaseReq" in struct["bases"]:
            base = _class_fields(io_tree, ("BaseReq",))["BaseReq"]["fields"]
            struct["fields"] = {**base, **struct["fields"]}
    api = _class_fields(ast.parse((src / "api/v1/api_types.py").read_text()), ("GenerateRequest", "SamplingParams"))
    routes = _routes(ast.parse((src / "srt/entrypoints/http_server.py").read_text()))
    if args.server_flags:
        flags = sorted(line.strip() for line in args.server_flags.read_text().splitlines() if line.strip())
        flag_source = "argparse of sglang.srt.server_args.ServerArgs.add_cli_args"
    else:
        flags = _field_flags(src / "srt/arg_groups/fields")
        flag_source = "field names of sglang/srt/arg_groups/fields/*.py"
    contract = {
        "sglang_version": version,
        "sources": {"requests": "sglang/srt/managers/io_struct.py", "generate": "sglang/api/v1/api_types.py",
                    "routes": "sglang/srt/entrypoints/http_server.py", "server_flags": flag_source,
                    "pins": f"{dist_info.name}/METADATA"},
        "pins": pins,
        "requests": requests,
        "generate": api,
        "routes": routes,
        "server_flags": flags,
    }
    out = args.out or pathlib.Path(__file__).resolve().parents[1] / f"tests/fixtures/sglang_{version}_contract.json"
    out.write_text(json.dumps(contract, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}: {len(requests)} request types, {len(routes)} routes, {len(flags)} server flags")
    return 0


if __name__ == "__main__":
    sys.exit(main())
