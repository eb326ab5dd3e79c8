package main

import (
	"os"
	"strconv"
	"strings"
	"time"
)

// machineCPU returns, from /proc/stat (Linux only), the CPU time every
// process on the machine has spent since boot in user and system mode, and
// the time the hypervisor ran something else while this machine's CPUs had
// work (steal). Interrupt time is left out of busy: the kernel counts it
// apart from the processes it serves, this one's loopback traffic included.
func machineCPU() (busy, steal time.Duration, ok bool) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0, false
	}
	line, _, _ := strings.Cut(string(b), "\n")
	// cpu  user nice system idle iowait irq softirq steal ...
	f := strings.Fields(line)
	if len(f) < 9 || f[0] != "cpu" {
		return 0, 0, false
	}
	var ticks [8]int64
	for i := range ticks {
		if ticks[i], err = strconv.ParseInt(f[i+1], 10, 64); err != nil {
			return 0, 0, false
		}
	}
	// /proc/stat counts in USER_HZ, 100 per second on every Linux
	// architecture Go runs on.
	const tick = time.Second / 100
	return time.Duration(ticks[0]+ticks[1]+ticks[2]) * tick, time.Duration(ticks[7]) * tick, true
}
