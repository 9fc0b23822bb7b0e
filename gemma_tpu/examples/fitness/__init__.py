"""Fitness coach: seven watch-data tools, a simulated device and Garmin Connect, a dataset generator.

    python -m gemma_tpu.examples.fitness generate --out data/fitness --seed 0
"""

from gemma_tpu.examples.fitness.providers import GarminConnectProvider, Provider, SimulatedDevice
from gemma_tpu.examples.fitness.tools import TOOLS, call_tool, system_prompt, tool_schemas, user_message

__all__ = ["GarminConnectProvider", "Provider", "SimulatedDevice", "TOOLS", "call_tool", "system_prompt",
           "tool_schemas", "user_message"]
