"""`tahnode join`: the stage daemon and its parts (membership client, heartbeats, checkpoint sync,
assignment follower, device and progress)."""
