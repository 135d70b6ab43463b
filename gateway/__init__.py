"""The HTTP gateway: OpenAI and Anthropic protocols in, jobs on Kafka, results back."""
