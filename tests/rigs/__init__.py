"""The project's own fault and bench rigs: Sentinel, RabbitMQ, chaos tools, the fork server."""
