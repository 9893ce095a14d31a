#!/bin/sh
# Prometheus on the host's network (deploy/docker/compose.hostnet.yml): writes its configuration from the
# ports the stack was given (the same variables as the services: LEARNER_METRICS_PORT, REWARD_PORT,
# CONTROL_PORT, and every port of ROLLOUT_METRICS_PORTS, the range workers pick their metrics port from),
# then runs Prometheus on 127.0.0.1:PROMETHEUS_PORT. A worker port nobody holds is a target that is down.
set -eu
config=/tmp/prometheus.yml
first=${ROLLOUT_METRICS_PORTS%-*}
last=${ROLLOUT_METRICS_PORTS#*-}
{
    echo "global:"
    echo "  scrape_interval: ${PROMETHEUS_SCRAPE_INTERVAL:-5s}"
    echo "  evaluation_interval: ${PROMETHEUS_SCRAPE_INTERVAL:-5s}"
    echo "scrape_configs:"
    for job in "learner:$LEARNER_METRICS_PORT" "reward:$REWARD_PORT" "control:$CONTROL_PORT"; do
        echo "  - job_name: ${job%%:*}"
        echo "    static_configs:"
        echo "      - targets: [\"127.0.0.1:${job#*:}\"]"
    done
    echo "  - job_name: rollout"
    echo "    static_configs:"
    echo "      - targets:"
    port=$first
    while [ "$port" -le "$last" ]; do
        echo "          - \"127.0.0.1:$port\""
        port=$((port + 1))
    done
} > "$config"
exec prometheus --config.file="$config" --storage.tsdb.path=/var/lib/prometheus/data \
    --web.listen-address="127.0.0.1:${PROMETHEUS_PORT:-9090}" "$@"
