"""Kafka: the bus (the only aiokafka importer), the local broker and cluster launcher, Kafka
settings, the service lifecycle."""
