"""The pure fold: commands, acks and heartbeats into fleet and rollout status. No I/O."""
