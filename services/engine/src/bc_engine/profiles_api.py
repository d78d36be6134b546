"""``profiles.*``, ``steps.list`` and ``plugins.list``: stored profiles, their validation and
rendering, the steps and driver operations a profile can use, and the plugins this engine runs."""

from __future__ import annotations

from typing import Any

from better_compute.app import App
from better_compute.core.errors import BcError, ErrorCode, join_path
from better_compute.provision import Profile
from better_compute.service import ApiRequest, Database
from better_compute.wire import engine as m
from better_compute.wire.paging import decode_cursor, take_page

from .documents import check_document
from .profiles import FoundProfile, ProfileStore, parse_document
from .resolve import Problem, resolve_profile

__all__ = ["ProfilesApi"]


class ProfilesApi:
    """The ``profiles.*`` and ``steps.list`` routes."""

    def __init__(self, *, app: App, db: Database, profiles: ProfileStore) -> None:
        self.app = app
        self.db = db
        self.profiles = profiles

    def _lenders(self) -> dict[str, str]:
        """Step id -> the module or plugin provision borrows it from."""
        provision = self.app.provision
        if provision is None:
            return {}
        return {step.id: module.id for module in provision.modules for step in module.steps}

    async def plugins_list(self, req: ApiRequest) -> m.PluginList:
        """The plugins the app registered (listed or discovered): what this engine runs."""
        req.decode(m.ListPlugins)
        provision = self.app.provision
        lent = {module.id for module in provision.modules} if provision is not None else set()
        plugins = []
        for plugin in sorted(self.app.plugins, key=lambda p: p.id):
            source = self.app.plugin_sources.get(plugin.id)
            plugins.append(
                m.PluginInfo(
                    id=plugin.id,
                    description=str(getattr(plugin, "description", "") or ""),
                    source="entry-point" if source is not None else "app",
                    entry_point=source.entry_point if source is not None else None,
                    target=source.value if source is not None else None,
                    distribution=source.distribution if source is not None else None,
                    version=source.version if source is not None else None,
                    lent=plugin.id in lent,
                    steps=sorted(s.id for s in plugin.steps),
                    profiles=[
                        m.PluginProfile(id=p.id, version=p.version)
                        for p in sorted(plugin.profiles, key=lambda p: p.key)
                    ],
                    config_units=sorted(u.name for u in getattr(plugin, "config_units", ())),
                    image_signers=sorted(s.id for s in getattr(plugin, "image_signers", ())),
                    command_kinds=sorted(k.name for k in plugin.command_kinds),
                    driver_operations=sorted(o.name for o in getattr(plugin, "driver_operations", ())),
                )
            )
        return m.PluginList(plugins=plugins)

    async def steps_list(self, req: ApiRequest) -> m.StepList:
        """The steps a profile's ``use`` resolves to and the driver operations, with their inputs."""
        req.decode(m.ListSteps)
        lenders = self._lenders()
        steps = [
            m.StepInfo(
                id=s.id,
                runs_on=s.runs_on,
                relays=list(s.relays),
                command=s.command,
                sends=list(s.sends),
                timeout_ms=s.timeout_ms,
                retry_safe=s.retry_safe,
                description=s.description,
                input=s.input.json_schema(),
                retry=s.retry.to_document() if s.retry is not None else None,
                plugin=lenders.get(s.id),
            )
            for s in sorted(self.app.steps.values(), key=lambda s: s.id)
        ]
        operations = [
            m.DriverOperationInfo(name=o.name, description=o.description, input=o.input.json_schema())
            for o in sorted(self.app.driver_operations.values(), key=lambda o: o.name)
        ]
        return m.StepList(steps=steps, driver_operations=operations)

    # -- profiles -------------------------------------------------------------

    async def profiles_create(self, req: ApiRequest) -> m.ProfileView:
        body = req.decode(m.CreateProfile)
        check_document(body.document)
        # A profile that does not validate is refused, every problem listed (as validate does).
        res = resolve_profile(self.app, _parsed(body.document))
        if res.problems:
            raise _resolution_error(res.problems, "document")
        try:
            async with self.db.transaction() as conn:
                found = await self.profiles.create(
                    conn,
                    tenant_id=body.tenant_id,
                    document=body.document,
                    public=body.public,
                    replace=body.replace,
                )
        except BcError as err:
            if err.code is ErrorCode.INVALID_CONFIG:
                raise err.with_path_prefix("document") from err
            raise
        return found.view()

    async def profiles_get(self, req: ApiRequest) -> m.ProfileView:
        body = req.decode(m.GetProfile)
        async with self.db.transaction() as conn:
            found = await self.profiles.find(
                conn, tenant_id=body.tenant_id, profile_id=body.id, version=body.version
            )
        return found.view()

    async def profiles_list(self, req: ApiRequest) -> m.ProfileList:
        body = req.decode(m.ListProfiles)
        after = decode_cursor(body.cursor, str, int, str)
        async with self.db.transaction() as conn:
            found = await self.profiles.list(
                conn, tenant_id=body.tenant_id, after=after, limit=body.limit + 1
            )
        page, next_ = take_page(
            [f.summary() for f in found], limit=body.limit, key=lambda d: (d.id, d.version, d.tenant_id),
            budget=req.page_budget,
        )  # fmt: skip
        return m.ProfileList(profiles=page, next=next_)

    async def profiles_delete(self, req: ApiRequest) -> m.ProfileDeleted:
        body = req.decode(m.DeleteProfile)
        async with self.db.transaction() as conn:
            await self.profiles.delete(
                conn, tenant_id=body.tenant_id, profile_id=body.id, version=body.version
            )
        return m.ProfileDeleted(deleted=True)

    async def _profile_for(self, body: m.ProfileRef) -> FoundProfile:
        if body.document is not None:
            check_document(body.document)
            return FoundProfile(_parsed(body.document), body.tenant_id, False, None)
        if body.id is None:
            raise BcError(ErrorCode.INVALID_INPUT, "give a profile id or a document", {"path": "id"})
        async with self.db.transaction() as conn:
            return await self.profiles.find(
                conn, tenant_id=body.tenant_id, profile_id=body.id, version=body.version
            )

    async def profiles_validate(self, req: ApiRequest) -> m.ProfileValidation:
        """Every unresolved ``use`` and rejected ``with``, each with its path."""
        body = req.decode(m.ProfileRef)
        try:
            found = await self._profile_for(body)
        except BcError as err:
            if err.code is not ErrorCode.INVALID_CONFIG:
                raise
            found_all = err.details.get("problems") or [
                {"path": err.path or "", "code": err.code.value, "message": err.message}
            ]
            return m.ProfileValidation(valid=False, problems=[m.Problem(**p) for p in found_all])
        res = resolve_profile(self.app, found.profile)
        at = "document" if body.document is not None else ""
        return m.ProfileValidation(
            valid=not res.problems,
            profile=m.ProfileKey(id=found.profile.id, version=found.profile.version),
            problems=[
                m.Problem(path=join_path(at, p.path), code=p.code, message=p.message) for p in res.problems
            ],
            command_kinds=res.command_kinds,
        )

    async def profiles_render(self, req: ApiRequest) -> m.ProfileRendering:
        """The expanded steps, as a workflow would persist them."""
        body = req.decode(m.ProfileRef)
        found = await self._profile_for(body)
        res = resolve_profile(self.app, found.profile)
        if res.problems:
            raise _resolution_error(res.problems, "document" if body.document is not None else "")
        return m.ProfileRendering(
            profile=m.ProfileKey(id=found.profile.id, version=found.profile.version),
            steps=[s.view() for s in res.steps],
            command_kinds=res.command_kinds,
        )


def _parsed(document: dict[str, Any]) -> Profile:
    """A profile document sent in a request, its problems named from the request
    (``document.steps[0].wiht``), every one of them in ``details.problems``."""
    try:
        return parse_document(document)
    except BcError as err:
        raise err.with_path_prefix("document") from err


def _resolution_error(problems: list[Problem], at: str) -> BcError:
    """The first problem of a profile's resolution, every one in ``details.problems``, their
    paths under ``at`` (``document`` when the request carried the profile)."""
    err = problems[0].to_error(problems=[p.to_document() for p in problems])
    return err.with_path_prefix(at) if at else err
