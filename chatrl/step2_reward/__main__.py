from chatrl.step2_reward.main import main

main()
