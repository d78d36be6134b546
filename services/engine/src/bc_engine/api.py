"""``bc.api.engine.*``: the engine's routes, each concern its own part.

* ``nodes_api``: ``nodes.*``;
* ``profiles_api``: ``profiles.*``, ``steps.list`` and ``plugins.list``;
* ``workflows_api``: ``workflows.*``, and ``start_in`` (steps and metal start workflows with it);
* ``why``: ``workflows.why``, what a node's or workflow's current step waits for;
* and the routes a plug-in of the engine adds through its hooks (``EngineHooks.routes``): metal's
  ``metal.*``, ``images.*`` and ``enrollmentRules.*`` (``bc_engine.metal``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from better_compute.app import App
from better_compute.service import ApiRequest

from .nodes_api import NodesApi
from .profiles import ProfileStore
from .profiles_api import ProfilesApi
from .steps.hooks import EngineHooks, Publish
from .why import WhyApi
from .workflows_api import WorkflowsApi

__all__ = ["EngineApi"]


class EngineApi:
    def __init__(
        self,
        *,
        app: App,
        db: Any,
        wake: Callable[[str], Awaitable[None]],
        publish: Publish,
        quorum: Any = None,
        pki: Any = None,
        hooks: EngineHooks | None = None,
        site_admission: Callable[[], int] = lambda: 0,
    ) -> None:
        self.app = app
        self.hooks = hooks if hooks is not None else EngineHooks()
        self.db = db
        self.profiles = ProfileStore(app)
        self.wake = wake
        self.publish = publish
        self.nodes = NodesApi(db=db, publish=publish, quorum=quorum, pki=pki)
        self.profiles_api = ProfilesApi(app=app, db=db, profiles=self.profiles)
        self.workflows = WorkflowsApi(
            app=app,
            db=db,
            profiles=self.profiles,
            wake=wake,
            publish=publish,
            hooks=self.hooks,
            site_admission=site_admission,
        )
        self.start_in = self.workflows.start_in
        self.why = WhyApi(db=db, cmdq=quorum.cmdq) if quorum is not None else None

    def routes(self) -> dict[str, Callable[[ApiRequest], Awaitable[Any]]]:
        nodes, profiles, workflows = self.nodes, self.profiles_api, self.workflows
        return {
            "nodes.create": nodes.nodes_create,
            "nodes.get": nodes.nodes_get,
            "nodes.list": nodes.nodes_list,
            "nodes.update": nodes.nodes_update,
            "nodes.label": nodes.nodes_label,
            "nodes.maintenance": nodes.nodes_maintenance,
            "nodes.delete": nodes.nodes_delete,
            "steps.list": profiles.steps_list,
            "plugins.list": profiles.plugins_list,
            "profiles.create": profiles.profiles_create,
            "profiles.get": profiles.profiles_get,
            "profiles.list": profiles.profiles_list,
            "profiles.delete": profiles.profiles_delete,
            "profiles.validate": profiles.profiles_validate,
            "profiles.render": profiles.profiles_render,
            "workflows.start": workflows.workflows_start,
            "workflows.get": workflows.workflows_get,
            "workflows.list": workflows.workflows_list,
            "workflows.abort": workflows.workflows_abort,
            "workflows.retry": workflows.workflows_retry,
            "workflows.resume": workflows.workflows_resume,
            **({"workflows.why": self.why.workflows_why} if self.why is not None else {}),
            **self.hooks.routes,
        }
