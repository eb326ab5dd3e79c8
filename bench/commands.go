package main

import (
	"strconv"
	"strings"
)

// commandStat is one command's counters in INFO commandstats: the calls
// made, and the µs spent running them. A script's usec include the commands
// it calls, which are counted under their own names as well.
type commandStat struct{ calls, usec int64 }

// perOp is one command's share of each operation of a row.
type perOp struct{ Calls, Usec float64 }

// parseCommandStats reads INFO commandstats, lines such as
//
//	cmdstat_evalsha:calls=10,usec=57,usec_per_call=5.70,rejected_calls=0,failed_calls=0
//
// into counters by command name ("client|setinfo" for a subcommand).
func parseCommandStats(info string) map[string]commandStat {
	stats := map[string]commandStat{}
	for line := range strings.Lines(info) {
		stat, fields, _ := strings.Cut(strings.TrimSpace(line), ":")
		name, ok := strings.CutPrefix(stat, "cmdstat_")
		if !ok {
			continue
		}
		var s commandStat
		for f := range strings.SplitSeq(fields, ",") {
			k, v, _ := strings.Cut(f, "=")
			switch k {
			case "calls":
				s.calls, _ = strconv.ParseInt(v, 10, 64)
			case "usec":
				s.usec, _ = strconv.ParseInt(v, 10, 64)
			}
		}
		stats[name] = s
	}
	return stats
}

// commandsPerOp divides what each command did between before and after by
// ops. The meter's own INFO calls are left out, and so are commands that did
// nothing in between.
func commandsPerOp(before, after map[string]commandStat, ops uint64) map[string]perOp {
	if before == nil || after == nil || ops == 0 {
		return nil
	}
	per := map[string]perOp{}
	for name, a := range after {
		b := before[name]
		if name == "info" || a.calls <= b.calls {
			continue
		}
		per[name] = perOp{float64(a.calls-b.calls) / float64(ops), float64(a.usec-b.usec) / float64(ops)}
	}
	return per
}
