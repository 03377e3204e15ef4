# Redis from Debian's redis-server package (7.0 on bookworm) on any Debian base image: for machines
# that reach Debian's packages but no image registry (scripts/compose-smoke.sh builds it and runs the
# stack with REDIS_IMAGE=pdserve-redis:7). With a registry, compose uses the official redis:7.4.
#   docker build -f deploy/docker/redis.Dockerfile --build-arg BASE_IMAGE=debian:bookworm-slim -t pdserve-redis:7 deploy/docker
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* && mkdir -p /data && chown redis:redis /data
USER redis
WORKDIR /data
VOLUME /data
EXPOSE 6379
CMD ["redis-server", "--dir", "/data", "--protected-mode", "no"]
