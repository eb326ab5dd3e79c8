package idempotency

import "net/http"

// RecordKey is the Redis key of k's record in s, for the external tests
// that must know which cluster master holds it.
func RecordKey(s *RedisStore, k Key) string {
	key, _ := s.recordKey(k)
	return key
}

// FormerFingerprint is r's fingerprint by the former release's rules, for
// a test that stores a record as that release would have.
func FormerFingerprint(r *http.Request, body []byte, headers []string) Fingerprint {
	return fingerprintBy(formerRules, r, body, headers)
}
