"""The orchestrator role, in parts that each own their state: `pool` (rollout servers: discovery, health, weight
push, choice), `client` (the RolloutBackend interface and its HTTP implementation), `buffer` (staleness budget,
dropping, batch formation, snapshot; pure), `driver` (the event loop that ties them together) and `app` (the HTTP
adapter and `moerl orchestrate`). Importing the package imports none of them."""
