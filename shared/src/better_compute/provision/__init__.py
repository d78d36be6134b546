"""Provision: steps, profiles, user-data templates and config units, and the module that
hands them to the engine."""

from .commands import CommandQueueAccess, CommandResult, await_command, site_agent_for
from .config_units import BUILTIN_CONFIG_UNITS, ConfigUnit, resolve_host_config, resolve_host_section
from .context import Log, Pki, Secrets, Sql, StepContext, StepNode, Workflows, step_command_key
from .labels import LabelExpression, parse_label_expression
from .module import ImageVerifier, ProvisionModule, provision_module
from .profiles import (
    Profile,
    ProfileStep,
    define_profile,
    profile_from_document,
)
from .results import latest_result, rendered_user_data
from .retry import RetryPolicy, parse_retry
from .steps import Step, define_step
from .templates import TEMPLATE_VARIABLES, UserData, render_template, template_variables
from .userdata import ProvisionedTarget, provisioned_target_resolver
from .waiting import CommandNotReady, StepNotReady, step_not_ready

__all__ = [
    "BUILTIN_CONFIG_UNITS",
    "TEMPLATE_VARIABLES",
    "CommandNotReady",
    "CommandQueueAccess",
    "CommandResult",
    "ConfigUnit",
    "ImageVerifier",
    "LabelExpression",
    "Log",
    "Pki",
    "Profile",
    "ProfileStep",
    "ProvisionModule",
    "ProvisionedTarget",
    "RetryPolicy",
    "Secrets",
    "Sql",
    "Step",
    "StepContext",
    "StepNode",
    "StepNotReady",
    "UserData",
    "Workflows",
    "await_command",
    "define_profile",
    "define_step",
    "latest_result",
    "parse_label_expression",
    "parse_retry",
    "profile_from_document",
    "provision_module",
    "provisioned_target_resolver",
    "render_template",
    "rendered_user_data",
    "resolve_host_config",
    "resolve_host_section",
    "site_agent_for",
    "step_command_key",
    "step_not_ready",
    "template_variables",
]
