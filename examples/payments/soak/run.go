package main

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"time"
)

// run is the soak: the service, the load and the chaos for cfg.duration,
// then the audit. An error means the soak could not run; what it found is
// in the summary.
func run(ctx context.Context, cfg config) (*summary, error) {
	dir, err := os.MkdirTemp("", "soak-")
	if err != nil {
		return nil, err
	}
	bin, err := build(ctx, dir)
	if err != nil {
		return nil, err
	}
	b, err := openBackend(ctx, cfg)
	if err != nil {
		return nil, err
	}
	defer b.close()
	svc, err := startService(b, bin, dir, cfg)
	if err != nil {
		return nil, err
	}
	defer svc.stop()

	tl := newTimeline(len(svc.slots))
	l := newLoad(svc, cfg.seed)
	start := time.Now()
	chaosCtx, stopChaos := context.WithTimeout(ctx, cfg.duration)
	defer stopChaos()
	chaosDone := make(chan error, 1)
	go func() { chaosDone <- chaos(chaosCtx, svc, tl, rand.New(rand.NewPCG(cfg.seed, 0xc4a05))) }()
	// The clients start charges until the chaos ends and see the ones they
	// started through, with every fault removed by then.
	l.run(ctx, chaosCtx, cfg.clients)
	if err := <-chaosDone; err != nil {
		return nil, err
	}
	s := &summary{cfg: cfg, elapsed: time.Since(start), senders: l.senders, faults: tl.byKind(), tl: tl, logs: dir}
	if err := s.audit(ctx, b, l); err != nil {
		return nil, err
	}
	if s.violations() == 0 {
		os.RemoveAll(dir)
		s.logs = ""
	}
	return s, nil
}

// audit checks what the service did. First the sweepers settle what the
// chaos abandoned: the records a killed owner held run out after one lease,
// and -sweep takes them over.
func (s *summary) audit(ctx context.Context, b backend, l *load) error {
	settle := time.Now().Add(3*s.cfg.lease + 10*s.cfg.sweep + 10*time.Second)
	for {
		var err error
		if s.inFlight, s.indexed, err = b.inFlight(ctx); err != nil {
			return fmt.Errorf("reading the records in flight: %w", err)
		}
		if s.inFlight+s.indexed == 0 || time.Now().After(settle) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if s.inFlight+s.indexed > 0 {
		s.problem("%d records still in flight and %d entries in the in-flight index after the sweepers ran", s.inFlight, s.indexed)
	}

	// Every client has one answer, a 201, and every sender of a key the
	// same one.
	first := map[string]*sender{}
	for _, c := range s.senders {
		if c.err != nil || c.final.status != http.StatusCreated {
			s.unanswered++
			s.problem("%s: no final answer after %d attempts in %v: %v %d %s", c.key, len(c.attempts), c.d, c.err, c.final.status, c.final.body)
			continue
		}
		if f, ok := first[c.key]; !ok {
			first[c.key] = c
		} else if !f.final.same(c.final) {
			s.lost++
			s.problem("%s: answered %s, then %s", c.key, f.final.body, c.final.body)
		}
	}

	// Every completed key replays its stored answer, byte for byte.
	for _, f := range first {
		r := l.resend(f, rand.New(rand.NewPCG(s.cfg.seed, uint64(f.amount))))
		l.send(ctx, r)
		s.replays++
		if r.err != nil || !r.final.replayed || !f.final.same(r.final) {
			s.lost++
			s.problem("%s: answered %d %s; sent again: %v %d %s (replayed %v)", f.key, f.final.status, f.final.body,
				r.err, r.final.status, r.final.body, r.final.replayed)
		}
	}

	// Every logical charge charged once at the gateway, and the charge its
	// clients were given; every charge in the ledger.
	gw, err := b.gatewayCharges(ctx)
	if err != nil {
		return fmt.Errorf("reading the gateway's charges: %w", err)
	}
	ledger, err := b.ledger(ctx)
	if err != nil {
		return fmt.Errorf("reading the ledger: %w", err)
	}
	s.charges = len(gw)
	byAmount := map[int64][]charge{}
	for _, c := range gw {
		byAmount[c.Amount] = append(byAmount[c.Amount], c)
	}
	for amount, cs := range byAmount {
		if len(cs) > 1 {
			s.double += len(cs) - 1
			s.problem("charge %d charged %d times at the gateway: %v", amount, len(cs), cs)
		}
	}
	for key, f := range first {
		var c charge
		if err := json.Unmarshal(f.final.body, &c); err != nil {
			return fmt.Errorf("%s: the 201's body: %w", key, err)
		}
		if cs := byAmount[f.amount]; len(cs) == 0 || cs[0].ID != c.ID {
			s.lost++
			s.problem("%s: answered charge %s, which the gateway did not make (its charges for %d: %v)", key, c.ID, f.amount, cs)
		}
	}
	inLedger := map[string]bool{}
	for _, c := range ledger {
		inLedger[c.ID] = true
	}
	for _, c := range gw {
		if !inLedger[c.ID] {
			s.lost++
			s.problem("gateway charge %s (%d) is not in the ledger", c.ID, c.Amount)
		}
	}
	return nil
}

func (s *summary) problem(format string, args ...any) {
	s.problems = append(s.problems, fmt.Sprintf(format, args...))
}
