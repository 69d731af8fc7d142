"""OpenEnv's own FastAPI server (`openenv.core.env_server.create_app`) for an Environment class, on
loopback, for `agent.openenv.transport: server` (openenv_env.py). It exits when its standard input
closes, so it never outlives the run that started it, even one killed with SIGKILL.

    python -m megatron_rl.recipes.agent.openenv_server package.module:EnvironmentClass --port 8123
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import threading

from megatron_rl.config import import_object
from megatron_rl.recipes.agent.openenv_env import environment_types


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", help="package.module:EnvironmentClass")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--env-args", default="{}", help="the class's keyword arguments, as JSON")
    parser.add_argument("--max-sessions", type=int, default=64)
    args = parser.parse_args(argv)

    import uvicorn  # optional: serves OpenEnv's app when a run asks for a server
    from openenv.core.env_server.http_server import create_app  # optional library: imported when used

    env_cls = import_object(args.target, "OpenEnv environment")
    action_cls, observation_cls = environment_types(env_cls)
    factory = functools.partial(env_cls, **json.loads(args.env_args))
    app = create_app(factory, action_cls, observation_cls, env_name=env_cls.__name__,
                     max_concurrent_envs=args.max_sessions)

    def exit_with_parent() -> None:
        sys.stdin.read()
        os._exit(0)

    threading.Thread(target=exit_with_parent, daemon=True).start()
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
