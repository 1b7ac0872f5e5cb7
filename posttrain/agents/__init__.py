"""Agents: tool calls, tools and environments for multi-turn episodes."""
