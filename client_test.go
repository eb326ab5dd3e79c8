package idempotency_test

import (
	"math"
	"testing"

	"github.com/idempotency-go/idempotency"
)

func TestRetryPolicyBackoffUnbounded(t *testing.T) {
	// A client that honours any Retry-After sets the longest MaxDelay; its
	// bound, plus one for the closed interval, must not overflow.
	p := idempotency.RetryPolicy{MaxDelay: math.MaxInt64}
	for _, attempt := range []int{1, 62, 63, 1000} {
		if d := p.Backoff(attempt); d < 0 {
			t.Errorf("Backoff(%d) = %v, want non-negative", attempt, d)
		}
	}
}
