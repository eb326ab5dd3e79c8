package idempotency_test

import (
	"testing"
	"time"

	"github.com/idempotency-go/idempotency"
)

func TestRetryPolicyBackoff(t *testing.T) {
	p := idempotency.RetryPolicy{BaseDelay: 10 * time.Millisecond, MaxDelay: 50 * time.Millisecond}
	bounds := []time.Duration{10, 20, 40, 50, 50, 50}
	for i, bound := range bounds {
		bound *= time.Millisecond
		var most time.Duration
		for range 2000 {
			d := p.Backoff(i + 1)
			if d < 0 || d > bound {
				t.Fatalf("Backoff(%d) = %v, want within [0, %v]", i+1, d, bound)
			}
			most = max(most, d)
		}
		// Full jitter spreads over the whole range: 2000 draws all in its
		// lower half would happen with probability 2^-2000.
		if most <= bound/2 {
			t.Errorf("Backoff(%d): largest of 2000 draws %v, want some above %v", i+1, most, bound/2)
		}
	}
	if d := p.Backoff(1000); d > 50*time.Millisecond {
		t.Errorf("Backoff(1000) = %v, want capped at 50ms", d)
	}
	if got := (idempotency.RetryPolicy{}).Attempts(); got != 4 {
		t.Errorf("zero RetryPolicy allows %d attempts, want the default 4", got)
	}
	if d := (idempotency.RetryPolicy{}).Backoff(1); d > 100*time.Millisecond {
		t.Errorf("zero RetryPolicy: Backoff(1) = %v, want within the default 100ms", d)
	}
}
