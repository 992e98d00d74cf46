/**
 * The network-namespace hosts of the multi-host tests: they live with the chaos campaign that
 * also runs on them (src/tools/chaos/netns.ts); re-exported here for the tests.
 */
export { type Host, Hosts, netnsUnavailable } from "../src/tools/chaos/netns.js";
