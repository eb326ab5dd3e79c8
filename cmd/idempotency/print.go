package main

import (
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/idempotency-go/idempotency"
)

// printer prints records as tables for people, or as JSON for scripts.
type printer struct {
	out  io.Writer
	json bool
}

// jsonRecord is a record as -json prints it.
type jsonRecord struct {
	Scope       string   `json:"scope"`
	Key         string   `json:"key"`
	State       string   `json:"state"`
	OperationID string   `json:"operation_id,omitempty"`
	Fingerprint string   `json:"fingerprint"`
	Attempt     int      `json:"attempt,omitempty"`
	Token       uint64   `json:"token,omitempty"`
	LeaseLeftMS int64    `json:"lease_left_ms,omitempty"`
	ExpiresInMS int64    `json:"expires_in_ms"`
	AgeMS       int64    `json:"age_ms,omitempty"`
	Status      int      `json:"status,omitempty"`
	HeaderNames []string `json:"header_names,omitempty"`
	BodySize    int      `json:"body_size,omitempty"`
	Steps       []string `json:"steps,omitempty"`
}

func toJSON(r idempotency.Record) jsonRecord {
	return jsonRecord{Scope: r.Key.Scope, Key: r.Key.Name, State: r.State.String(), OperationID: r.OperationID,
		Fingerprint: hex.EncodeToString(r.Fingerprint[:]), Attempt: r.Attempt, Token: r.Token,
		LeaseLeftMS: r.LeaseLeft.Milliseconds(), ExpiresInMS: r.ExpiresIn.Milliseconds(), AgeMS: r.Age.Milliseconds(),
		Status: r.Status, HeaderNames: r.HeaderNames, BodySize: r.BodySize, Steps: r.Steps}
}

func (p printer) record(r idempotency.Record) error {
	if p.json {
		return json.NewEncoder(p.out).Encode(toJSON(r))
	}
	w := tabwriter.NewWriter(p.out, 0, 4, 2, ' ', 0)
	row := func(name string, v any) { fmt.Fprintf(w, "%s\t%v\n", name, v) }
	row("scope", fmt.Sprintf("%q", r.Key.Scope))
	row("key", r.Key.Name)
	row("state", r.State)
	row("operation", r.OperationID)
	row("fingerprint", hex.EncodeToString(r.Fingerprint[:]))
	if r.Attempt > 0 {
		row("attempt", r.Attempt)
		row("token", r.Token)
	}
	switch r.State {
	case idempotency.RecordInFlight:
		row("lease", "ends in "+r.LeaseLeft.Round(time.Millisecond).String())
	case idempotency.RecordAbandoned:
		row("lease", "ran out "+(-r.LeaseLeft).Round(time.Millisecond).String()+" ago")
	case idempotency.RecordCompleted:
		row("status", r.Status)
		row("headers", strings.Join(r.HeaderNames, ", "))
		row("body", fmt.Sprintf("%d bytes", r.BodySize))
	}
	if len(r.Steps) > 0 {
		row("steps", strings.Join(r.Steps, ", "))
	}
	if r.Age > 0 {
		row("age", r.Age.Round(time.Second))
	}
	row("expires", "in "+r.ExpiresIn.Round(time.Second).String())
	return w.Flush()
}

func (p printer) list(recs []idempotency.Record, next string) error {
	if p.json {
		enc := json.NewEncoder(p.out)
		for _, r := range recs {
			if err := enc.Encode(toJSON(r)); err != nil {
				return err
			}
		}
		if next != "" {
			return enc.Encode(map[string]string{"next": next})
		}
		return nil
	}
	w := tabwriter.NewWriter(p.out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "STATE\tSCOPE\tKEY\tATTEMPT\tLEASE\tOPERATION\tSTEPS")
	for _, r := range recs {
		lease := "ends in " + r.LeaseLeft.Round(time.Millisecond).String()
		if r.State == idempotency.RecordAbandoned {
			lease = "ran out " + (-r.LeaseLeft).Round(time.Millisecond).String() + " ago"
		}
		fmt.Fprintf(w, "%s\t%q\t%s\t%d\t%s\t%s\t%s\n", r.State, r.Key.Scope, r.Key.Name, r.Attempt, lease, r.OperationID,
			strings.Join(r.Steps, ","))
	}
	if err := w.Flush(); err != nil {
		return err
	}
	if next != "" {
		_, err := fmt.Fprintf(p.out, "more: -after %s\n", next)
		return err
	}
	return nil
}

func (p printer) stats(st idempotency.Stats) error {
	if p.json {
		return json.NewEncoder(p.out).Encode(map[string]int64{"in_flight": st.InFlight, "abandoned": st.Abandoned})
	}
	_, err := fmt.Fprintf(p.out, "in flight  %d\nabandoned  %d\n", st.InFlight, st.Abandoned)
	return err
}

func (p printer) message(m string) error {
	if p.json {
		return json.NewEncoder(p.out).Encode(map[string]string{"message": m})
	}
	_, err := fmt.Fprintln(p.out, m)
	return err
}
