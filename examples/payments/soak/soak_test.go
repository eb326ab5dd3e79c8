package main

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/idempotency-go/idempotency/internal/testkit/report"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

// TestSoak runs the soak briefly on each store, on a server the test
// starts: the chaos must have injected faults of most kinds, the clients
// made charges under them, and the audit found nothing wrong.
func TestSoak(t *testing.T) {
	for _, store := range []string{"redis", "postgres"} {
		t.Run(store, func(t *testing.T) {
			cfg := config{store: store, duration: 8 * time.Second, instances: 3, clients: 8, seed: 15,
				lease: time.Second, wait: 5 * time.Second, sweep: 250 * time.Millisecond, work: 20 * time.Millisecond}
			if store == "redis" {
				cfg.redis = testserver.StartRedis(t).Addr
			} else {
				cfg.postgres = testserver.StartPostgres(t).DSN
			}
			s, err := run(t.Context(), cfg)
			if err != nil {
				t.Fatal(err)
			}
			var out strings.Builder
			s.print(&out)
			t.Log("\n" + out.String())
			report.Add(t, s.entry())
			if n := s.violations(); n > 0 {
				t.Errorf("%d violations", n)
			}
			// A floor that says the load ran, not a speed: a charge is three
			// recorded steps, some 13 store round trips on PostgreSQL, and the
			// instances may run under the race detector on a loaded machine.
			ops, _, _ := s.counts()
			if ops < 30 {
				t.Errorf("only %d charges made", ops)
			}
			var kinds int
			for _, n := range s.faults {
				if n > 0 {
					kinds++
				}
			}
			if kinds < 4 {
				t.Errorf("faults of only %d kinds injected: %v", kinds, s.faults)
			}
			if s.replays == 0 || s.charges != s.replays {
				t.Errorf("%d gateway charges, %d keys replayed: %s", s.charges, s.replays, fmt.Sprint(s.problems))
			}
		})
	}
}
