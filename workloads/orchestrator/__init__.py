"""The orchestrator role, in parts that each own their state: `pool` (rollout servers: discovery, health, weight
push, choice), `client` (the RolloutBackend interface and its HTTP implementation), `buffer` (staleness budget,
dropping, batch formation, snapshot; pure), `driver` (the event loop that ties them together), `evaluation`
(periodic evaluation through the rollout servers) and `app` (the HTTP adapter and `moerl orchestrate`).
It imports only the shared floor (workloads/rl, core), neither the rollout server nor the trainer. Importing the
package imports none of them."""
