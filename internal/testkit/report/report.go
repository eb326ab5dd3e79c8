// Package report lets the reliability suite's tests, in every module of the
// workspace, leave one line each of what they tried and what they found, so
// that one summary can be printed at the end of a run (see summary/).
//
// A test calls Add. Nothing is written unless the environment variable
// IDEMPOTENCY_REPORT names a file; each entry is appended to it as one JSON
// line, so test binaries running in parallel can share the file.
package report

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

// Env is the environment variable naming the file entries are appended to.
const Env = "IDEMPOTENCY_REPORT"

// Entry is what one test tried and what it found. Counts a test does not
// measure stay zero; the summary adds them up by suite and store.
type Entry struct {
	// Suite names the part of the reliability suite: "faults",
	// "restarts", "linearizable", "hostile", "soak", "fuzz".
	Suite string `json:"suite"`
	// Store is the store the test ran against: "memory", "redis",
	// "redis-cluster", "postgres".
	Store string `json:"store,omitempty"`
	// Server is the server a Redis store ran against when it was not
	// redis-server: the one $IDEMPOTENCY_REDIS_SERVER names
	// (testserver.RedisServerEnv), say "valkey-server". Write fills it in
	// for a Store whose name starts with "redis", so that the summary
	// counts a run on Valkey apart from one on Redis.
	Server string `json:"server,omitempty"`
	// Case names the test or the scenario.
	Case string `json:"case,omitempty"`
	// Faults counts the faults injected, by kind ("latency", "reset",
	// "timeout", "partition", "kill", "sigstop", ...).
	Faults map[string]int `json:"faults,omitempty"`
	// Operations counts the operations (or store calls) attempted.
	Operations int `json:"operations,omitempty"`
	// Duplicates counts the requests that repeated an earlier one's key.
	Duplicates int `json:"duplicates,omitempty"`
	// DoubleExecutions counts operations that ran more than once while
	// another attempt could still have been running, or charged twice.
	DoubleExecutions int `json:"double_executions"`
	// LostCompletions counts completed outcomes lost or replaced.
	LostCompletions int `json:"lost_completions"`
	// StrandedWaiters counts waiters that were never answered.
	StrandedWaiters int `json:"stranded_waiters"`
	// Linearizable is porcupine's verdict: "Ok", "Illegal" or "Unknown".
	Linearizable string `json:"linearizable,omitempty"`
	// PeakHeap is the heap's peak above its start, in bytes.
	PeakHeap uint64 `json:"peak_heap,omitempty"`
	// FuzzExecs counts a fuzz target's executions.
	FuzzExecs int64 `json:"fuzz_execs,omitempty"`
	// Notes is anything else worth a line in the summary (a measured
	// tail latency, what a restart lost).
	Notes string `json:"notes,omitempty"`
}

// Add appends e to the report file, if IDEMPOTENCY_REPORT names one, and
// fails t if it cannot. An empty Case is t's name. Without the variable it
// does nothing, so tests run by hand leave nothing behind.
func Add(t testing.TB, e Entry) {
	t.Helper()
	if e.Case == "" {
		e.Case = t.Name()
	}
	if err := Write(e); err != nil {
		t.Fatal(err)
	}
}

// Write appends e to the report file, if IDEMPOTENCY_REPORT names one; it
// is Add for a program that is not a test (the soak command).
func Write(e Entry) error {
	path := os.Getenv(Env)
	if path == "" {
		return nil
	}
	if e.Server == "" && strings.HasPrefix(e.Store, "redis") {
		if bin := filepath.Base(testserver.RedisServer()); bin != "redis-server" {
			e.Server = bin
		}
	}
	line, err := json.Marshal(e)
	if err != nil {
		return fmt.Errorf("report: %w", err)
	}
	// One write of one line with O_APPEND: lines from test binaries
	// running at once do not interleave.
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		return fmt.Errorf("report: %w", err)
	}
	if _, err := f.Write(append(line, '\n')); err != nil {
		f.Close()
		return fmt.Errorf("report: %w", err)
	}
	return f.Close()
}
