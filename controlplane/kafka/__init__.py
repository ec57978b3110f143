"""Kafka: the bus (producer, consumer, admin, health over one client base: the only aiokafka
importers), the local broker and cluster launcher, Kafka settings, the service lifecycle."""
