"""Named timing profiles for the elastic layer, as the environment variables a node reads.

SHORT_TIMEOUTS is the profile of the elastic tests and benchmarks (docs/elastic.md, "Short-timeout
test profile"): failures are detected within seconds, yet there are no false evictions on a busy 2-core
machine. Real runs across continents keep the defaults (heartbeat 2 s / timeout 10 s).
"""

SHORT_TIMEOUTS = {
    "ZERO_BAND_EDM_HEARTBEAT_INTERVAL_SECONDS": "0.5",
    "ZERO_BAND_EDM_HEARTBEAT_TIMEOUT_SECONDS": "5",
    "ZB_ELASTIC_SYNC_DEADLINE": "10",
    "ZERO_BAND_GLOBAL_PG_TIMEOUT_SECONDS": "5",
    "ZERO_BAND_GLOBAL_STORE_TIMEOUT_SECONDS": "30",
    "ZERO_BAND_GLOBAL_STORE_POLLING_INTERVAL_SECONDS": "0.05",
    "ZB_ELASTIC_CONNECT_TIMEOUT": "10",
    "ZB_ELASTIC_START_TIMEOUT": "40",
}
