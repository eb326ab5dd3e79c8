package idempotency

import (
	"context"
	"log/slog"
)

// SlogObserver returns an Observer that logs every event to l, at the level
// of what an operator must do about it:
//   - Debug: an operation executed, replayed, waited for, released or
//     forgotten; a confirmed renewal.
//   - Info: a takeover, a recovery, a sweep, and the answers to clients'
//     own mistakes or departures (in flight, mismatch, invalid key, client
//     gone).
//   - Warn: a lost lease (fenced), a recovery that could not tell, a request
//     run unguarded (failed open), a renewal that failed.
//   - Error: a store call that failed (unavailable), and a sweep that did.
//
// The message is "idempotency " and the event's kind; attributes carry the
// outcome, scope, method, route, attempt, durations, the failed store call
// and the error, each only when it applies.
func SlogObserver(l *slog.Logger) Observer { return slogObserver{l} }

type slogObserver struct{ l *slog.Logger }

func (s slogObserver) Observe(ctx context.Context, e Event) {
	level := levelOf(e)
	if !s.l.Enabled(ctx, level) {
		return
	}
	attrs := make([]slog.Attr, 0, 8)
	add := func(a slog.Attr, ok bool) {
		if ok {
			attrs = append(attrs, a)
		}
	}
	add(slog.String("outcome", e.Outcome.String()), e.Kind == EventOutcome)
	attrs = append(attrs, slog.String("scope", e.Scope))
	add(slog.String("method", e.Method), e.Method != "")
	add(slog.String("route", e.Route), e.Route != "")
	add(slog.Int("attempt", e.Attempt), e.Attempt > 0)
	add(slog.Duration("duration", e.Duration), e.Duration > 0)
	add(slog.Duration("waited", e.Waited), e.Waited > 0)
	add(slog.Bool("abandoned", e.Abandoned), e.Kind == EventTakeover)
	add(slog.Int("found", e.Found), e.Kind == EventSweep)
	add(slog.Int("settled", e.Settled), e.Kind == EventSweep)
	add(slog.Int("left", e.Left), e.Kind == EventSweep)
	add(slog.String("op", e.Op), e.Op != "")
	add(slog.Any("err", e.Err), e.Err != nil)
	s.l.LogAttrs(ctx, level, "idempotency "+e.Kind.String(), attrs...)
}

func levelOf(e Event) slog.Level {
	switch e.Kind {
	case EventRenewal:
		if e.Err != nil {
			return slog.LevelWarn
		}
		return slog.LevelDebug
	case EventTakeover:
		return slog.LevelInfo
	case EventSweep:
		if e.Err != nil {
			return slog.LevelError
		}
		return slog.LevelInfo
	case EventOperator:
		// A record changed by hand, on a production store.
		if e.Err != nil {
			return slog.LevelError
		}
		return slog.LevelWarn
	}
	switch e.Outcome {
	case OutcomeExecuted, OutcomeReplayed, OutcomeWaitedReplayed, OutcomeWaitedOwner, OutcomeReleased, OutcomeForgotten:
		return slog.LevelDebug
	case OutcomeFenced, OutcomeRecoveryUnknown, OutcomeFailedOpen:
		return slog.LevelWarn
	case OutcomeUnavailable:
		return slog.LevelError
	}
	return slog.LevelInfo
}
