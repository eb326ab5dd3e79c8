package idempotency

// RecordKey is the Redis key of k's record in s, for the external tests
// that must know which cluster master holds it.
func RecordKey(s *RedisStore, k Key) string {
	key, _ := s.recordKey(k)
	return key
}
