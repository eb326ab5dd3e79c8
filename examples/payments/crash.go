package main

import (
	"context"
	"fmt"
	"log"
	"os"
	"slices"
	"sync/atomic"
	"syscall"

	"github.com/idempotency-go/idempotency"
)

// crasher kills its process with SIGKILL, as a crash would, right after
// every nth run of one step of a charge in it by an operation's first
// attempt: how the tests' kill audit (TestKillAudit) crashes instances
// between two steps of many charges. Retries never count, so that however
// often they meet a crash, the crashes end and every charge is answered. A
// nil crasher never kills.
type crasher struct {
	step  string
	every int64
	runs  atomic.Int64
}

// newCrasher returns the crasher of -crash-after step -crash-every every,
// or nil when step is "".
func newCrasher(step string, every int) (*crasher, error) {
	switch {
	case step == "":
		return nil, nil
	case !slices.Contains([]string{"order", "charge", "receipt"}, step):
		return nil, fmt.Errorf("-crash-after %q: want order, charge or receipt", step)
	case every < 1:
		return nil, fmt.Errorf("-crash-every %d: want 1 or more", every)
	}
	return &crasher{step: step, every: int64(every)}, nil
}

// after is called right after step ran in the operation in ctx and, with
// recovery points, was recorded.
func (c *crasher) after(ctx context.Context, step string) {
	if c == nil || step != c.step {
		return
	}
	if info, _ := idempotency.FromContext(ctx); info.Attempt > 1 || c.runs.Add(1)%c.every != 0 {
		return
	}
	log.Printf("crash: killed right after step %s", step)
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {} // the signal ends every goroutine; this one goes no further meanwhile
}
