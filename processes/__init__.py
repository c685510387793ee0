"""What makes a Loom process: start-up and shutdown, CPU placement, the ZeroMQ channels between
the API, scheduler and worker processes."""
